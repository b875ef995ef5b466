"""Which model and policy a gateway request runs under.

Clients that can only set ``model`` (IDE assistants, most tools) still get a policy, through
an alias; clients that can set headers choose one per request. In order:

1. the model: an alias of ``[gateway.aliases]`` stands for its ``model`` (an alias may shadow
   a real model name, to give it a policy); otherwise a model some node serves; otherwise 400
   listing the served models and aliases;
2. the policy: the ``x-zml-policy`` header, else the alias's ``policy``, else
   ``[gateway] default_policy``, else none (any healthy node serving the model). A named
   policy the client does not know is a 400 listing the known ones.

An unknown name is echoed in the 400 cut to its first :data:`ECHO_CHARS` characters, and a
name longer than :data:`SUGGEST_MAX_CHARS` gets no "did you mean": no model or policy name is
that long, and comparing one with every known name would hold up the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zml.config import suggest
from zml.errors import PolicyConfigError
from zml.policy import Policy

from .errors import ErrorReply, invalid_request
from .settings import GatewaySettings

__all__ = ["ECHO_CHARS", "SUGGEST_MAX_CHARS", "Selection", "Selector"]

ECHO_CHARS = 100
"""How much of an unknown model or policy name a 400 repeats."""
SUGGEST_MAX_CHARS = 256
"""Names longer than this get no suggestion (``difflib`` is quadratic in their length)."""


@dataclass(frozen=True)
class Selection:
    """The model sent to the nodes and the policy (by name) the request runs under."""

    model: str
    policy: str | None
    source: str | None = None
    """Where the policy came from: ``x-zml-policy`` (the header), ``model`` (an alias) or
    ``default_policy``; None without a policy."""


class Selector:
    """Resolves a request's ``model`` and ``x-zml-policy`` against the gateway's config."""

    def __init__(self, settings: GatewaySettings, served: Iterable[str],
                 policies: Mapping[str, Policy]) -> None:
        self.settings = settings
        self.served: frozenset[str] = frozenset(served)
        self.policies = policies
        self._aliases = {name: (a.model, a.policy) for name, a in settings.aliases.items()}

    def check(self, source: str | None) -> None:
        """Fail (PolicyConfigError) on an alias or default naming an unknown model or policy."""
        default = self.settings.default_policy
        if default is not None and default not in self.policies:
            raise PolicyConfigError(
                f"[gateway] default_policy = {default!r} is not a known policy ("
                f"known: {self._known_policies()})", field="gateway.default_policy",
                value=default, suggestion=suggest(default, self.policies), source=source)
        for name, (model, policy) in self._aliases.items():
            if model not in self.served:
                raise PolicyConfigError(
                    f"[gateway.aliases] {name!r}: no node serves model {model!r} (served: "
                    f"{', '.join(sorted(self.served)) or 'none'})",
                    field=f"gateway.aliases.{name}.model", value=model,
                    suggestion=suggest(model, self.served), source=source)
            if policy is not None and policy not in self.policies:
                raise PolicyConfigError(
                    f"[gateway.aliases] {name!r}: policy {policy!r} is not a known policy "
                    f"(known: {self._known_policies()})",
                    field=f"gateway.aliases.{name}.policy", value=policy,
                    suggestion=suggest(policy, self.policies), source=source)

    def models(self) -> dict[str, tuple[str, str | None] | None]:
        """Every model name the gateway accepts: alias -> (model, policy), served -> None."""
        out: dict[str, tuple[str, str | None] | None] = dict.fromkeys(sorted(self.served))
        out.update(self._aliases)
        return out

    def select(self, model: object, header_policy: str | None) -> Selection | ErrorReply:
        """The request's selection, or the 400 to answer with."""
        if not isinstance(model, str) or not model:
            return invalid_request("'model' must be a non-empty string naming a served model "
                                   "or an alias (GET /v1/models lists them)", "model")
        alias = self._aliases.get(model)
        policy: str | None
        if alias is not None:
            model, policy = alias
        elif model in self.served:
            policy = None
        else:
            hint = _suggest(model, self.models())
            return invalid_request(
                f"unknown model {_echo(model)}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (served models: {', '.join(sorted(self.served)) or 'none'}; aliases: "
                + f"{', '.join(sorted(self._aliases)) or 'none'})",
                "model", code="model_not_found")
        if header_policy is not None:
            policy, param = header_policy, "x-zml-policy"
        elif policy is not None:
            param = "model"
        else:
            policy, param = self.settings.default_policy, "default_policy"
        if policy is None:
            return Selection(model, None)
        if policy not in self.policies:
            hint = _suggest(policy, self.policies)
            return invalid_request(
                f"unknown policy {_echo(policy)}" + (f"; did you mean {hint!r}?" if hint else "")
                + f" (known policies: {self._known_policies()})", param,
                code="unknown_policy")
        return Selection(model, policy, param)

    def _known_policies(self) -> str:
        return ", ".join(sorted(self.policies)) or "none are configured"


def _echo(name: str) -> str:
    """``name`` quoted for a message, cut to :data:`ECHO_CHARS` characters."""
    if len(name) <= ECHO_CHARS:
        return repr(name)
    return f"{name[:ECHO_CHARS]!r}... ({len(name)} characters)"


def _suggest(name: str, choices: Iterable[str]) -> str | None:
    return None if len(name) > SUGGEST_MAX_CHARS else suggest(name, choices)
