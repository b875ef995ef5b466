"""The 0.2 way, still supported: fallback by try/except around pinned calls.

0.3 code would name a policy instead (``policy="llama3-production"``); this pattern keeps
working unchanged, and ``zml.ZMLRoutingError`` is still the name to catch.
"""

import zml

client = zml.Client(api_key="...")
messages = [{"role": "user", "content": "Hello"}]

for accelerator in ("H100", "MI300X", "H100_PCIe"):
    try:
        response = client.infer(
            model="meta-llama/llama-3-8b-instruct",
            messages=messages,
            accelerator=accelerator,
        )
        break
    except zml.ZMLRoutingError as e:
        print(f"{accelerator} unavailable: {e.routing_context['final_error']}")
else:
    raise SystemExit("no accelerator family could serve the request")

print(f"served on {response.routing.accelerator} by {response.routing.node_id}")
client.close()
