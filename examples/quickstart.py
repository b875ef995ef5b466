"""Quickstart: an inline policy, as in the zml 0.3 release post.

Run from this folder with the example fleet served (`zml sim serve zml.toml`), or anywhere
with ZML_CONFIG pointing at a zml.toml that registers H100, MI300X and H100_PCIe.
"""

import zml

client = zml.Client(api_key="...")

# Define a policy inline
policy = zml.Policy(
    name="llama3-production",
    accelerator_chain=["H100", "MI300X", "H100_PCIe"],
    latency_target_ms=500,
    cost_priority="balanced",
)

response = client.infer(
    model="meta-llama/llama-3-8b-instruct",
    messages=[{"role": "user", "content": "Hello"}],
    policy=policy,
)

print(response.choices[0].message.content)
print(f"served by {response.routing.node_id} ({response.routing.accelerator}), "
      f"queue depth {response.routing.queue_depth}")
client.close()
