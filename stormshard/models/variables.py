"""Which dataset variables a model reads and writes.

- prognostic: read and predicted (the model predicts their increment: residual prediction);
- forcing: read only (e.g. insolation, orography);
- diagnostic: predicted only (e.g. precipitation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["VariableIndex"]


@dataclass(frozen=True)
class VariableIndex:
    """Positions of the model's input and output variables among the dataset's ``variables``.

    ``input_idx``: dataset positions of the input variables (prognostic + forcing, dataset order);
    ``output_idx``: dataset positions of the output variables (prognostic + diagnostic);
    ``prognostic_in_input`` / ``prognostic_in_output``: where the prognostic variables sit in the
    input and output tensors (same order), for the residual connection.
    """

    variables: tuple[str, ...]
    forcing: tuple[str, ...]
    diagnostic: tuple[str, ...]

    @classmethod
    def build(cls, variables: Sequence[str], forcing: Sequence[str] = (), diagnostic: Sequence[str] = ()) -> VariableIndex:
        variables = tuple(variables)
        if len(set(variables)) != len(variables):
            raise ValueError(f"the dataset lists a variable twice: {variables}")
        for field, names in (("forcing", forcing), ("diagnostic", diagnostic)):
            unknown = sorted(set(names) - set(variables))
            if unknown:
                raise ValueError(f"{field} variables {unknown} are not in the dataset's variables {list(variables)}")
        both = sorted(set(forcing) & set(diagnostic))
        if both:
            raise ValueError(f"variables {both} are listed as both forcing and diagnostic; a variable is one or the other")
        index = cls(variables, tuple(forcing), tuple(diagnostic))
        if not index.prognostic:
            raise ValueError("no prognostic variable left: at least one variable must be neither forcing nor diagnostic")
        return index

    @property
    def prognostic(self) -> tuple[str, ...]:
        return tuple(v for v in self.variables if v not in self.forcing and v not in self.diagnostic)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(v for v in self.variables if v not in self.diagnostic)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(v for v in self.variables if v not in self.forcing)

    @property
    def input_idx(self) -> list[int]:
        return [self.variables.index(v) for v in self.input_names]

    @property
    def output_idx(self) -> list[int]:
        return [self.variables.index(v) for v in self.output_names]

    @property
    def prognostic_in_input(self) -> list[int]:
        return [self.input_names.index(v) for v in self.prognostic]

    @property
    def prognostic_in_output(self) -> list[int]:
        return [self.output_names.index(v) for v in self.prognostic]

    @property
    def forcing_in_input(self) -> list[int]:
        return [self.input_names.index(v) for v in self.forcing]
