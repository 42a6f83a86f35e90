"""Examples, importable as a package from the repository root (``model.name:
"examples.custom_architecture:build"``; ``launch/train.py`` puts the root on ``sys.path``)."""
