"""zml's built-in behaviour, written as plugins and registered like installed ones.

* :mod:`.static_fleet`: ``zml.toml``'s ``[accelerators.*]`` and ``[[nodes]]`` (a fleet source).
* :mod:`.toml_policies`: ``zml.toml``'s ``[policies.NAME]`` tables (a policy source).
* :mod:`.cost`: the default cost model (node-seconds or tokens).
* :mod:`.otel`: OpenTelemetry spans and metrics, through ``opentelemetry-api`` only.

Their plugin names are ``zml.static_fleet``, ``zml.toml_policies``, ``zml.cost`` and
``zml.otel``: ``client.plugins.unregister(name="zml.otel")`` turns tracing off for a client.
"""
