"""Custom plugins registered in code: policies from a JSON file, chargeback per team.

Run from a folder whose ./zml.toml (or $ZML_CONFIG) describes the fleet, e.g. next to
examples/zml.toml served by `zml sim serve examples/zml.toml`. The named policies come from
policies.json beside this script (a policy-source plugin) and, for names it does not know,
from zml.toml; every response's cost is charged to the team in its `metadata`.
"""

from pathlib import Path

from chargeback import Chargeback, JsonPolicyPlugin

import zml

HERE = Path(__file__).resolve().parent

chargeback = Chargeback()
with zml.Client(api_key="...") as client:
    client.plugins.register(JsonPolicyPlugin(HERE / "policies.json"), name="json-policies")
    client.plugins.register(chargeback, name="chargeback")
    print("policies:", ", ".join(sorted(client.policies)))

    calls = [
        ("search", "interactive"),
        ("support", "support-bot"),
        ("support", "support-bot"),
        ("finance", "llama3-production"),  # not in policies.json: zml.toml's table
    ]
    for team, policy in calls:
        response = client.infer(
            model="meta-llama/llama-3-8b-instruct",
            messages=[{"role": "user", "content": "Say hello."}],
            policy=policy,
            metadata={"team": team},
            max_tokens=8,
        )
        r = response.routing
        cost = r.cost.amount if r.cost else 0.0
        print(f"{team} {policy}: {r.node_id} ({r.accelerator}), {cost:.8f} USD")

for line in chargeback.report():
    print(line)
