"""``zml.Policy``: a named routing policy, validated when it is built.

A policy that names an accelerator family the fleet does not have is a configuration mistake;
it must fail where it is written (``Policy(...)``, a ``[policies.X]`` table, a policy-store
push), not as a routing failure under load. So every path that produces a Policy validates it
against a :class:`~zml.config.Registry`: the one passed in, or the *default registry*.

The rule: ``zml.Policy(...)`` is validated at construction against the default registry, the
configuration discovered from ``$ZML_CONFIG`` or ``./zml.toml`` plus fleet-source plugins
(re-read when the file changes). A client checks every policy it is given against its own
registry too, and raises PolicyConfigError naming its config file when a family is unknown
there; ``client.policy({...})`` builds a policy against one client's registry directly. No
client ever changes which registry ``zml.Policy`` uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .config import Registry, first_error, suggest
from .errors import PolicyConfigError
from .validation import MAX_SECONDS, check_policy_mapping, name_problem

__all__ = ["CostPriority", "Policy", "PolicyRef", "resolve_policy", "validate_policy_tables"]

CostPriority = Literal["cost", "latency", "balanced"]
_COST_PRIORITIES = ("cost", "latency", "balanced")
Strategy = Literal["round_robin", "random", "least_busy", "latency_based"]
_STRATEGIES = ("round_robin", "random", "least_busy", "latency_based")
Affinity = Literal["prefix"]
_AFFINITIES = ("prefix",)

# The registry a Policy being built right now is checked against, when it is not the default
# one (a client validating a dict or a config table against its own registry). A ContextVar:
# its value belongs to the code building the policy, never to the process.
_validating_against: ContextVar[Registry | None] = ContextVar("zml_policy_registry", default=None)


class Policy(BaseModel):
    """A named routing policy: which accelerator families to try, in which order, and how.

    Args:
        name: the policy's name (reported in ``response.routing.policy`` and routing errors).
        accelerator_chain: the families to try, in order of preference; non-empty, no
            duplicates, each registered in the fleet (``[accelerators.NAME]`` or a fleet source).
        latency_target_ms: the time to first token the caller needs, a finite number of ms
            (an int or a float; not a bool or a string); nodes predicted to exceed it are
            skipped (``cost_priority="cost"`` allows a 25% margin). None: no target.
        cost_priority: ``"cost"`` holds to earlier (cheaper) families up to full capacity;
            ``"latency"`` moves on once a family passes 80% utilisation; ``"balanced"`` weighs the
            cost saving of staying against latency risk. See :mod:`zml.routing`.
        queue_on_saturation: when no node is viable, wait in a client-side queue for capacity
            instead of raising RoutingError at once (a bool: ``1`` or ``"yes"`` is refused).
        max_queue_ms: how long a request may wait in that queue, a number of ms up to a year
            (default: the request's timeout).
        health_threshold: nodes whose health score (0..1, a number) is below it are skipped.
        strategy: None (zml's own routing) or a baseline strategy for side-by-side trials:
            ``"round_robin"``, ``"random"``, ``"least_busy"`` or ``"latency_based"`` (see
            :mod:`zml.strategies`); a strategy ignores the chain order, the latency target and
            cost, as the peers it imitates do.
        affinity: None, or ``"prefix"``: prefer the node likely to hold the prompt's leading
            prefix blocks, within a load bound (see :mod:`zml.routing`).

    Raises:
        PolicyConfigError: at construction, for any invalid field or unregistered family.
    """

    # Numbers and booleans are strict: ``true`` is not 1 ms, ``"no"`` is not False, ``"0.5"``
    # is not a number (an int is still a valid float); ``inf`` is refused like ``nan``.
    model_config: ClassVar[ConfigDict] = ConfigDict(
        frozen=True, extra="forbid", defer_build=True, allow_inf_nan=False
    )

    name: str = Field(min_length=1)
    accelerator_chain: tuple[str, ...] = Field(min_length=1)
    latency_target_ms: float | None = Field(default=None, gt=0, strict=True)
    cost_priority: CostPriority = "balanced"
    queue_on_saturation: bool = Field(default=False, strict=True)
    max_queue_ms: float | None = Field(default=None, gt=0, le=MAX_SECONDS * 1000, strict=True)
    health_threshold: float = Field(default=0.5, ge=0, le=1, strict=True)
    strategy: Strategy | None = None
    affinity: Affinity | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise policy_error_from_validation(exc, data.get("name")) from None

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        problem = name_problem(name)  # it is sent back in x-zml-policy and metric labels
        if problem is not None:
            raise ValueError(problem)
        return name

    @field_validator("accelerator_chain", mode="before")
    @classmethod
    def _ordered(cls, chain: object) -> object:
        # A set would be taken as a tuple in whatever order its hash gives (another family
        # first in another process); only a list or tuple says which family comes first.
        if not isinstance(chain, (list, tuple)):
            raise ValueError(f"must be a list of families in order of preference, e.g. "
                             f"['H100', 'MI300X'], got {type(chain).__name__}")
        return chain

    @field_validator("accelerator_chain")
    @classmethod
    def _no_duplicates(cls, chain: tuple[str, ...]) -> tuple[str, ...]:
        seen: set[str] = set()
        for family in chain:
            if family in seen:
                raise ValueError(f"family {family!r} appears twice; list each family once")
            seen.add(family)
        return chain

    @model_validator(mode="after")
    def _families_registered(self) -> Policy:
        registry = _validating_against.get()
        if registry is None:
            from .plugins.fleet_sources import default_registry

            registry = default_registry()
        check_families(self.name, self.accelerator_chain, registry)
        return self


PolicyRef = Policy | str | Mapping[str, Any]
"""What ``infer(policy=...)`` accepts: a Policy, the name of a configured policy, or a dict."""


def check_families(name: str, chain: Iterable[str], registry: Registry) -> None:
    """Raise PolicyConfigError if a family in ``chain`` is not registered in ``registry``."""
    families = registry.families
    for i, family in enumerate(chain):
        if family in families:
            continue
        if not families:
            where = registry.source or "no zml.toml was found: ZML_CONFIG is unset and there is no ./zml.toml"
            raise PolicyConfigError(
                f"policy {name!r}: accelerator_chain[{i}] = {family!r} is not registered: the "
                f"fleet registry has no accelerator families ({where}); add "
                f"[accelerators.{family}] and its [[nodes]] to zml.toml, set ZML_CONFIG to "
                "your zml.toml, or build the policy for one client with client.policy({...})",
                field="accelerator_chain",
                value=family,
                source=registry.source,
            )
        hint = suggest(family, families)
        known = ", ".join(families)
        raise PolicyConfigError(
            f"policy {name!r}: accelerator_chain[{i}] = {family!r} is not a registered "
            f"accelerator family (registered: {known})"
            + (f"; did you mean {hint!r}?" if hint else ""),
            field="accelerator_chain",
            value=family,
            suggestion=hint,
            source=registry.source,
        )


def policy_error_from_validation(exc: ValidationError, name: object) -> PolicyConfigError:
    """A PolicyConfigError naming the field, the bad value and a close match, from pydantic's."""
    err = first_error(exc)
    fld = ".".join(str(p) for p in err["loc"]) or "policy"
    value = err.get("input")
    hint: str | None = None
    prefix = f"policy {name!r}: " if name is not None else "a policy: "
    if err["type"] == "extra_forbidden":
        hint = suggest(fld, Policy.model_fields)
        msg = f"{prefix}unknown field {fld!r}" + (
            f"; did you mean {hint!r}?"
            if hint
            else f"; the fields are {', '.join(Policy.model_fields)}"
        )
    elif err["type"] == "missing":
        msg = f"{prefix}field {fld!r} is required" + (
            " (a policy given as a dict names itself: {'name': 'my-policy', ...})"
            if fld == "name" else "")
    else:
        if fld == "cost_priority" and isinstance(value, str):
            hint = suggest(value, _COST_PRIORITIES)
        elif fld == "strategy" and isinstance(value, str):
            hint = suggest(value, _STRATEGIES)
        elif fld == "affinity" and isinstance(value, str):
            hint = suggest(value, _AFFINITIES)
        msg = f"{prefix}{fld} = {value!r}: {err['msg']}" + (
            f"; did you mean {hint!r}?" if hint else ""
        )
    return PolicyConfigError(msg, field=fld, value=value, suggestion=hint)


def policy_from_mapping(
    data: Mapping[str, Any], registry: Registry, *, table: str | None = None
) -> Policy:
    """Validate a dict (from code, a config table or a policy store) into a Policy."""
    if not isinstance(data, Mapping):
        raise PolicyConfigError(
            f"a policy must be a table/dict of Policy fields, got {type(data).__name__}",
            field=table or "policy",
            value=data,
        )
    body = dict(data)
    if table is not None:
        body.setdefault("name", table)
    token = _validating_against.set(registry)
    try:
        return Policy(**body)
    except PolicyConfigError as exc:
        if table is not None and registry.source and not str(exc).startswith(registry.source):
            raise PolicyConfigError(
                f"{registry.source}: [policies.{table}] {exc}",
                field=exc.field,
                value=exc.value,
                suggestion=exc.suggestion,
                source=registry.source,
            ) from None
        raise
    finally:
        _validating_against.reset(token)


def validate_policy_tables(registry: Registry) -> dict[str, Policy]:
    """Validate every ``[policies.NAME]`` of a registry (at load: errors name file and table)."""
    return {
        name: policy_from_mapping(table, registry, table=name)
        for name, table in registry.policies.items()
    }


def resolve_policy(
    ref: PolicyRef | None,
    registry: Registry,
    named: Mapping[str, Policy],
) -> Policy | None:
    """Turn what ``infer(policy=...)`` was given into a validated Policy (or None).

    ``named`` holds the policies known by name (zml.toml tables and policy-source plugins).
    """
    if ref is None or isinstance(ref, Policy):
        if ref is not None:
            try:
                check_families(ref.name, ref.accelerator_chain, registry)
            except PolicyConfigError as exc:
                if not registry.source:
                    raise
                raise PolicyConfigError(
                    f"{registry.source}: {exc} (the policy was built for another registry "
                    "than this client's)",
                    field=exc.field,
                    value=exc.value,
                    suggestion=exc.suggestion,
                    source=registry.source,
                ) from None
        return ref
    if isinstance(ref, str):
        policy = named.get(ref)
        if policy is None:
            hint = suggest(ref, named)
            known = ", ".join(sorted(named)) or "none are configured"
            raise PolicyConfigError(
                f"unknown policy {ref!r} (known policies: {known})"
                + (f"; did you mean {hint!r}?" if hint else "")
                + "; define it under [policies.NAME] in zml.toml or pass a zml.Policy",
                field="policy",
                value=ref,
                suggestion=hint,
            )
        return policy
    if isinstance(ref, Mapping):
        check_policy_mapping(ref)
        return policy_from_mapping(ref, registry)
    raise PolicyConfigError(
        f"policy must be a zml.Policy, a policy name or a dict, got {type(ref).__name__}",
        field="policy",
        value=ref,
    )
