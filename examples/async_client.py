"""The async client: concurrent requests and a streamed answer, with cancellation.

``async with`` closes the client's connections. Leaving ``async with client.infer_stream(...)``
closes that stream's connection at once, and the node drops the request. (A bare ``async for``
left with ``break`` is closed too, at the next ``await``: Python finalizes an abandoned async
generator in a task.)
"""

import asyncio

import zml

MODEL = "meta-llama/llama-3-8b-instruct"


async def generate(client: zml.AsyncClient, prompt: str) -> zml.ChatCompletion:
    return await client.infer(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        policy="llama3-production",
    )


async def main() -> None:
    async with zml.AsyncClient(api_key="...") as client:
        prompts = [f"Explain tensor parallelism, take {i}" for i in range(6)]
        for response in await asyncio.gather(*(generate(client, p) for p in prompts)):
            print(f"{response.routing.node_id:>12} ({response.routing.accelerator})")

        text = []
        async for chunk in client.infer_stream(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream me a haiku"}],
            policy="llama3-production",
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        print("streamed:", "".join(text).strip(), f"[{chunk.routing.node_id}]")

        async with client.infer_stream(
            model=MODEL, messages=[{"role": "user", "content": "A long essay"}],
            policy="llama3-production",
        ) as stream:
            async for _chunk in stream:
                break  # leaving the block closes the connection: the node drops the request
        print("in flight after cancelling:", client.fleet.in_flight)


asyncio.run(main())
