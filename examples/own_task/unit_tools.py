"""A tool of your own: unit conversion for lengths. Named in tools.yaml as `class_name: unit_tools.UnitConvertTool`
(this folder on PYTHONPATH); its `config:` keys are the fields of `config_class` (an unknown key fails at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_stepwise.tools.base import Tool

METERS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "mi": 1609.344}


@dataclass
class UnitConvertConfig:
    precision: int = 6  # significant digits of the result


class UnitConvertTool(Tool):
    """`unit_convert(value, from_unit, to_unit)`; the executor has already checked the arguments against the schema
    in tools.yaml. A ValueError becomes an error message the model reads, not a crash."""

    config_class = UnitConvertConfig

    async def call(self, arguments):
        source, target = arguments["from_unit"], arguments["to_unit"]
        for unit in (source, target):
            if unit not in METERS:
                raise ValueError(f"unknown unit {unit!r}; known: {sorted(METERS)}")
        value = float(arguments["value"]) * METERS[source] / METERS[target]
        return f"{value:.{self.cfg.precision}g} {target}"
