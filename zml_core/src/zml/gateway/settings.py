"""The ``[gateway]`` table of ``zml.toml``: what ``zml serve`` reads besides the fleet.

``zml.config`` keeps the table as a raw mapping on the :class:`~zml.Registry` (the SDK itself
never reads it); it is validated here, when a gateway is built, so that a typo in it fails
``zml serve`` at start with the key and the bad value, like every other configuration error::

    [gateway]
    default_policy = "llama3-production"   # when neither the header nor an alias names one
    api_keys_env = "ZML_GATEWAY_KEYS"      # comma-separated gateway keys in this variable
    api_keys_file = "gateway-keys.txt"     # and/or SHA-256 hashes in a file (see zml.gateway.auth)
    max_body_bytes = 4194304               # larger request bodies get 413
    body_timeout_s = 30                    # a body not in full by then gets 408
    head_timeout_s = 10                    # request line and headers not in full by then: 408
    send_timeout_s = 60                    # a client reading nothing of its answer that long:
                                           # connection closed, request cancelled
    shutdown_timeout_s = 30                # on SIGTERM/Ctrl-C, requests in flight (streams)
                                           # get this long to finish, then are cancelled
    allowed_hosts = ["llm.example.com"]    # names besides loopback ones (zml.gateway.hosts)

    [gateway.aliases]
    "chat" = { model = "meta-llama/llama-3-8b-instruct", policy = "llama3-production" }
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from zml.config import (
    NOT_SHOWN,
    Registry,
    env_name_problem,
    first_error,
    shown_value,
    suggest,
    without_secrets,
)
from zml.errors import PolicyConfigError, safe_detail

__all__ = ["Alias", "GatewaySettings", "gateway_settings"]

_HOST = re.compile(r"\.?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?|\[?[0-9A-Fa-f:.]+\]?")
"""A host name (a leading dot: the domain and its subdomains) or an IPv4/IPv6 address."""

NODE_KEY_ENV = "ZML_API_KEY"
"""Where the node key comes from (the client's default); gateway keys must live elsewhere."""


class _Strict(BaseModel):
    """Base of the gateway's settings tables: unknown keys are refused, values frozen."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid", frozen=True)


class Alias(_Strict):
    """``[gateway.aliases] NAME = {model = ..., policy = ...}``: a model name clients may send."""

    model: str = Field(min_length=1)
    """The model the nodes serve."""
    policy: str | None = None
    """The policy requests under this alias use (None: the header's or ``default_policy``)."""


class GatewaySettings(_Strict):
    """The validated ``[gateway]`` table (every key optional)."""

    default_policy: str | None = None
    """The policy of a request whose header and model name none (None: no policy, 0.2 style)."""
    aliases: dict[str, Alias] = {}
    """Model names served by the gateway that stand for a model and, optionally, a policy."""
    api_keys_env: str | None = None
    """An environment variable holding the gateway keys, comma-separated."""
    api_keys_file: str | None = None
    """A file of SHA-256 hashes of gateway keys, relative to the config file's folder."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, strict=True)
    """The largest request body accepted (413 beyond)."""
    body_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, strict=True)
    """Seconds a request's body may take to arrive in full, from its headers (408 beyond): a
    client that stalls mid-body must not hold a connection open for ever."""
    head_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False, strict=True)
    """Seconds a request's head (request line and headers) may take to arrive in full, from
    the connection's opening or the end of the previous response on it: beyond, the connection
    is closed (with a 408 if part of a head had arrived). A client that connects and sends
    nothing, or a header byte now and then, must not hold a connection open for ever either
    (see :mod:`zml.gateway.protocol`)."""
    shutdown_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, strict=True)
    """Seconds ``zml serve`` waits, when told to stop (SIGTERM, Ctrl-C), for the requests in
    flight to finish; then it cancels them (a stream ends without ``[DONE]``, its node slot is
    freed) and exits. Without a bound, one long stream kept the process running until killed
    (a container's grace period ends in SIGKILL)."""
    send_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False, strict=True)
    """Seconds a client may read nothing of its response while the connection's write buffer
    is full: beyond, the connection is closed and the request cancelled (a stream's node slot
    freed). A client that stops reading must not hold a node for ever (see
    :mod:`zml.gateway.protocol`)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names, besides loopback ones, that a request arriving over loopback may be
    addressed to, and that a web page's ``Origin`` may name (``.example.com``: the domain and
    its subdomains; ``"*"``: any host, both checks off). See :mod:`zml.gateway.hosts`."""

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _host_names(cls, value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise ValueError('must be a list of host names, e.g. ["llm.example.com"]')
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f"must hold host names (strings), not {item!r}")
            if item != "*" and not _HOST.fullmatch(item):
                raise ValueError(
                    f"{safe_detail(item, 80)!r} is not a host name: give the name alone (no "
                    'scheme, port or path), ".example.com" for a domain and its subdomains, '
                    'or "*" for any host')
        return value

    @field_validator("api_keys_env")
    @classmethod
    def _not_the_node_key(cls, value: str | None) -> str | None:
        problem = None if value is None else env_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        if value is not None and value == NODE_KEY_ENV:
            raise ValueError(
                f"must name a variable other than {NODE_KEY_ENV} (the key zml sends to nodes): "
                "gateway keys and node keys are kept apart"
            )
        return value

    @property
    def auth_configured(self) -> bool:
        """Whether gateway keys are configured (requests then need a valid Bearer key)."""
        return self.api_keys_env is not None or self.api_keys_file is not None

    def keys_file(self, source: str | None) -> Path | None:
        """``api_keys_file`` resolved against the folder of the config file ``source``."""
        if self.api_keys_file is None:
            return None
        path = Path(self.api_keys_file).expanduser()
        if not path.is_absolute() and source is not None:
            path = Path(source).resolve().parent / path
        return path


def gateway_settings(registry: Registry) -> GatewaySettings:
    """Validate ``registry.gateway``; a bad key raises PolicyConfigError naming it."""
    where = registry.source or "configuration"
    data: Any = dict(registry.gateway)
    try:
        return GatewaySettings.model_validate(data)
    except ValidationError as exc:
        err = first_error(exc)
        loc = "gateway" + "".join(f".{part}" for part in err["loc"])
        value = without_secrets(err.get("input"), err["loc"][-1] if err["loc"] else None)
        hint: str | None = None
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            known = Alias.model_fields if "aliases" in err["loc"] else GatewaySettings.model_fields
            hint = suggest(key, known)
            msg = f"{where}: unknown key {loc}" + (f"; did you mean {hint!r}?" if hint else "")
            value = None  # not kept: a key pasted under a wrong name (api_keys = [...]) is one
        elif err["type"] == "missing":
            msg = f"{where}: {loc} is required"
        else:
            msg = f"{where}: {loc} = {shown_value(value)}: {err['msg']}"
        raise PolicyConfigError(msg, field=loc, value=None if value is NOT_SHOWN else value,
                                suggestion=hint, source=registry.source) from None
