"""Pass contracts: what each DeepCompile pass needs before it and what it may not run beside.

A schedule is ``[(step, [pass, ...]), ...]``; at each listed step DeepCompile recompiles the original graph and
runs that step's passes left to right. A pass may name capabilities it ``requires`` (some earlier pass of the same
step must ``provide`` them) and passes it ``conflicts_with`` (never in one step, whichever declares it).
``validate_schedule`` checks a schedule against the registered contracts before anything is compiled, so a bad
schedule fails with a message naming the pass and the step instead of a broken graph deep inside a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

# Capability tags shared by the built-in passes (tags, not pass names, so a pass can be swapped for another that
# provides the same thing).
CAP_Z3_GATHER_RELEASE = "z3_gather_release"  # zero3_compile's allgather_param / release_param nodes are in the graph
CAP_OPT_STATES_EVICTED = "opt_states_evicted"  # optimizer states left the accelerator before the profile was taken

PHASES = ("forward", "backward", "both")


@dataclass(frozen=True)
class PassContract:
    """What a pass provides, requires and conflicts with. ``phase`` (forward/backward/both) is descriptive.

    The pass's identity is the name it is registered under, not a field here, so one contract object may serve
    several names.
    """

    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    conflicts_with: frozenset[str] = frozenset()
    phase: str = "both"

    def __post_init__(self) -> None:
        for field_name in ("provides", "requires", "conflicts_with"):
            value = getattr(self, field_name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(f"PassContract.{field_name} must be a set of names, got {value!r}")
            object.__setattr__(self, field_name, frozenset(value))
        if self.phase not in PHASES:
            raise ValueError(f"PassContract.phase must be one of {PHASES}, got {self.phase!r}")


class PassContractError(ValueError):
    """A pass schedule breaks a registered contract (a missing requirement or a conflict)."""


# name -> contract. Module level because passes register at import and the engine validates later.
_pass_contracts: dict[str, PassContract] = {}

_NO_CONTRACT = PassContract()


def register_pass_contract(name: str, contract: PassContract | None) -> None:
    """Record ``contract`` for pass ``name``; ``None`` forgets any earlier contract (the pass becomes free)."""
    if contract is None:
        _pass_contracts.pop(name, None)
        return
    if not isinstance(contract, PassContract):
        raise TypeError(f"register_pass_contract({name!r}, ...) takes a PassContract or None, got {contract!r}")
    _pass_contracts[name] = contract


def get_pass_contract(name: str) -> PassContract | None:
    return _pass_contracts.get(name)


def _pass_name(entry: str | Callable, name_registry: Mapping[str, Callable] | None) -> str | None:
    """The registered name of a schedule entry: a name as written, a callable found by identity, else None."""
    if isinstance(entry, str):
        return entry
    if not name_registry:
        return None
    # Identity, not equality: passes may be partials or objects with odd __eq__/__hash__.
    names = sorted(name for name, fn in name_registry.items() if fn is entry)
    if len(names) > 1:
        raise PassContractError(f"pass callable {entry!r} is registered under multiple names {names}; write the "
                                "name you mean in the schedule so its contract is unambiguous")
    return names[0] if names else None


def _conflicts_of(name: str) -> frozenset[str]:
    return _pass_contracts.get(name, _NO_CONTRACT).conflicts_with


def _check_step(step: int, entries: Iterable, name_registry: Mapping[str, Callable] | None) -> None:
    provided: set[str] = set()
    earlier: list[str] = []
    for entry in entries:
        name = _pass_name(entry, name_registry)
        if name is None:  # an anonymous callable: nothing to check it against
            continue
        contract = _pass_contracts.get(name, _NO_CONTRACT)
        missing = contract.requires - provided
        if missing:
            raise PassContractError(f"pass {name!r} at step {step} requires {sorted(missing)}, which no earlier "
                                    f"pass of that step provides (passes before it: {earlier})")
        # symmetric: either side may declare the conflict
        clashes = {other for other in earlier
                   if other in contract.conflicts_with or name in _conflicts_of(other)}
        if clashes:
            raise PassContractError(f"pass {name!r} at step {step} conflicts with {sorted(clashes)} scheduled "
                                    "before it in the same step")
        provided |= contract.provides
        earlier.append(name)


def validate_schedule(schedule: Iterable[tuple[int, list]],
                      name_registry: Mapping[str, Callable] | None = None) -> None:
    """Check every step of ``schedule`` against the registered contracts; raise PassContractError on the first fault.

    Entries are pass names or pass callables; a callable is resolved to its name through ``name_registry``
    (``{name: fn}``). A pass without a contract constrains nothing but can still be named in another's conflicts.
    Steps are independent: each step recompiles from the original graph, so a capability from step 0 does not
    satisfy a requirement at step 10.
    """
    for item in schedule:
        try:
            step, entries = item
        except (TypeError, ValueError):
            raise PassContractError(f"a schedule entry must be (step, [passes]), got {item!r}") from None
        _check_step(step, entries, name_registry)
