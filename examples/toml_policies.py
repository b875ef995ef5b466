"""Policies kept in zml.toml and referenced by name: the recommended production setup.

The policy tables live in ./zml.toml (or $ZML_CONFIG), version-controlled apart from the code;
changing the chain is a config change, not a deploy of application code.
"""

import zml

with zml.Client(api_key="...") as client:
    for name in client.policies:
        print(f"policy {name}: {' -> '.join(client.policies[name].accelerator_chain)}")

    for policy in ("llama3-production", "batch"):
        response = client.infer(
            model="meta-llama/llama-3-8b-instruct",
            messages=[{"role": "user", "content": "Summarise our Q3 incident review."}],
            policy=policy,  # references a [policies.NAME] table
            max_tokens=32,
        )
        r = response.routing
        print(f"{policy}: {r.node_id} ({r.accelerator}); trace: {r.evaluated}")
