"""The typed result every operation returns: a dataclass, rendered by the CLI as rich text
(from its fields, by attribute) or, through `to_dict()`, as one JSON object that always says `ok`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass
class Result:
    """Base of the operations' results. `ok` is False when the operation found problems
    (verify) or a threshold failed (replay); an operation that cannot run raises instead."""

    @property
    def ok(self) -> bool:
        return True

    def to_dict(self, json_safe: bool = True) -> dict[str, Any]:
        """Plain data: `ok` first, then the fields; for JSON (the default) NaN and infinity become
        None, for people they stay numbers ("nan", "inf" in a table say what is in the file)."""
        data = {"ok": self.ok, **dataclasses.asdict(self)}
        return _json_safe(data) if json_safe else data


def _json_safe(value: Any) -> Any:
    """Standard JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
