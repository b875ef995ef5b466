"""``python -m zml_policy_sqlite``: the same as the ``zml-policy-sqlite`` command."""

from .cli import main

main()
