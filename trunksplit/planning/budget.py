"""Memory budgets and memory sizes: one parser for every entry point.

The trunk, ``apply_activation_checkpointing``, ``fit``, the CLI and the launcher's config all
take a budget or a size written one of several ways; :meth:`MemoryBudget.parse` reads them all
with one rule, so the same value means the same thing everywhere:

==========================================  =============================================
value                                       meaning
==========================================  =============================================
``None``, ``0``, ``0.0``, ``"0"``           no budget (off), as vissl's configs write it
a float in (0, 1], or such a string         a fraction of the step's peak without checkpointing
an int >= 1, or a whole float above 1       bytes (YAML writes bytes as a float: ``2.0e+9``)
a size string: ``"2GiB"``, ``"500MB"``      bytes
a float above 1 that is not whole (1.5)     refused: most likely a percentage (did you mean 0.015?)
negative, NaN, infinite                     refused (``ValueError``)
``True``/``False``, other types             refused (``TypeError``): a bool is no size
==========================================  =============================================

A memory *size* (``fit``'s memory) is the same with fractions and "off" refused. A budget of 2 to
100 bytes (``memory_budget=50``, meant as 50%?) is read as bytes too, and its refusal, since no step
fits, says so and how to write the percentage (:meth:`MemoryBudget.percent_hint`).
"""
import math
import re
from dataclasses import dataclass
from typing import Optional, Union

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = re.compile(r"\s*([+-]?(?:[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|nan|inf|infinity))\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
WRITE = "a fraction in (0, 1], bytes (2e9) or a size (2GiB, 500MiB)"


def gib(n: int) -> str:
    """Bytes as people read them: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_bytes(n: int) -> str:
    """Bytes as people read them, beside the exact count: ``512.0 MiB (536870912 bytes)``."""
    return f"{gib(n)} ({n} bytes)"


@dataclass(frozen=True)
class MemoryBudget:
    """A training step's memory budget: a ``fraction`` of the step's peak without checkpointing,
    or ``bytes``; exactly one is set. Build it with :meth:`parse` (which also accepts a
    ``MemoryBudget``); ``in_bytes`` resolves it against the unsplit peak once that is measured.

    Example::

        MemoryBudget.parse(0.5).in_bytes(400 * 2**20)   # 200 MiB
        MemoryBudget.parse("2GiB").bytes                # 2147483648
        MemoryBudget.parse(0)                           # None: no budget
    """

    fraction: Optional[float] = None
    bytes: Optional[int] = None

    def __post_init__(self):
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError("a MemoryBudget is a fraction or bytes, exactly one of them")

    @classmethod
    def parse(cls, value: Union[None, int, float, str, "MemoryBudget"], name: str = "memory_budget") -> Optional["MemoryBudget"]:
        """``value`` read by the rule in this module's docstring; None where it means no budget.
        ``name`` is what error messages call the value (``MEMORY_BUDGET``, ``--budget``)."""
        if isinstance(value, MemoryBudget):
            return value
        number, unit = _number_and_unit(value, name)
        if number == 0 and not unit:
            return None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{name} must be 0 (off), {WRITE}; got {value!r}")
        if unit:
            return cls(bytes=max(1, int(number * _UNITS[unit])))
        if isinstance(number, int):
            return cls(bytes=number)
        if number <= 1:
            return cls(fraction=float(number))
        if number != int(number):
            raise ValueError(f"{name} {value!r} is neither a fraction in (0, 1] nor a whole number of bytes (did you mean {number / 100:g}?)")
        return cls(bytes=int(number))

    def in_bytes(self, unsplit: int) -> int:
        """The budget in bytes, a fraction taken of ``unsplit`` (the step's peak without checkpointing)."""
        return int(self.fraction * unsplit) if self.fraction is not None else self.bytes

    def percent_hint(self) -> str:
        """Where a budget of 2 to 100 bytes was most likely meant as a percentage (``memory_budget=50``),
        a note saying how it was read and what to write; else empty. No step fits in 100 bytes."""
        if self.bytes is not None and 1 < self.bytes <= 100:
            return f" ({self.bytes} is read as bytes, as every whole number is: for {self.bytes}% of the unsplit step write {self.bytes / 100:g})"
        return ""

    def __str__(self) -> str:
        return f"{self.fraction:g} of the unsplit step" if self.fraction is not None else format_bytes(self.bytes)


class BudgetTooLowError(ValueError):
    """No plan meets a memory budget at this input. ``smallest_bytes`` is the lowest step peak the
    planner reaches (a budget it meets), ``None`` where it refused before searching (the parameters'
    gradients alone are above the budget); ``unsplit_bytes`` is the step's peak without checkpointing;
    ``held``: the refused call's updates in backward were held, so its backward kept every gradient.
    The message says why and what would help; nothing was changed. A ``ValueError``, as every
    refused argument, so code that catches those still does. Where the floor will do::

        try:
            plan = trunk.plan_for(x)
        except BudgetTooLowError as e:
            if e.smallest_bytes is None:
                raise
            trunk = CheckpointedTrunk(model, memory_budget=e.smallest_bytes)   # the floor, in bytes
    """

    def __init__(self, message: str, smallest_bytes: Optional[int], unsplit_bytes: int, held: bool = False):
        super().__init__(message)
        self.smallest_bytes, self.unsplit_bytes, self.held = smallest_bytes, unsplit_bytes, held


def parse_memory_size(value: Union[int, float, str], name: str = "memory size") -> int:
    """A memory size in bytes (``16GiB``, ``500MiB``, ``2e9``, ``2147483648``), by the budget's rule,
    with fractions, 0 and negative sizes refused: a size is absolute."""
    refusal = f"{name} must be a positive size in bytes (2e9) or with a unit (16GiB, 500MiB), got {value!r}"
    number, _ = _number_and_unit(value, name, write="bytes (2e9) or a size (16GiB, 500MiB)")
    if not number > 0:  # before the budget's rule, whose message offers 0 for "off"
        raise ValueError(refusal)
    budget = MemoryBudget.parse(value, name)
    if budget.bytes is None:
        raise ValueError(refusal)
    return budget.bytes


def _number_and_unit(value, name: str, write: str = WRITE):
    """(a number, the unit written after it or ""): ints stay ints, a string's number is a float.
    ``write``: what the refusal of an unreadable value offers."""
    if isinstance(value, bool) or not isinstance(value, (type(None), int, float, str)):
        raise TypeError(f"{name} must be {write}{' (or 0 for none)' if write == WRITE else ''}, got {type(value).__name__} {value!r}")
    if value is None:
        return 0, ""
    if not isinstance(value, str):
        return value, ""
    match = _SIZE.fullmatch(value)
    if not match or (match.group(2) or "B") not in _UNITS:  # the units' case matters: mb is no MB
        raise ValueError(f"cannot read {name} from {value!r}: write {write}{_as_fraction(value) if write == WRITE else ''}")
    return float(match.group(1)), match.group(2) or ""


def _as_fraction(value: str) -> str:
    """``" (50% is 0.5)"`` for a percentage of the unsplit step, which a budget writes as a fraction; else ``""``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%\s*", value)
    return f" ({match.group(1)}% is {float(match.group(1)) / 100:g})" if match and 0 < float(match.group(1)) <= 100 else ""
