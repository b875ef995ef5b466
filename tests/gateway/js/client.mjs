// The official openai npm package against a zml gateway: run by tests/gateway/test_npm_sdk.py.
// Usage: node client.mjs BASE_URL API_KEY MODEL; prints one JSON object with what it saw.
import OpenAI from "openai";

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30000 });
const messages = [{ role: "user", content: "hello from node" }];
const out = {};

// A JSON completion, with the response headers.
const { data, response } = await client.chat.completions
  .create({ model, messages, max_tokens: 5 })
  .withResponse();
out.json = {
  content: data.choices[0].message.content,
  completionTokens: data.usage.completion_tokens,
  zmlRouting: data.zml_routing,
  headers: {
    node: response.headers.get("x-zml-node-id"),
    accelerator: response.headers.get("x-zml-accelerator"),
    policy: response.headers.get("x-zml-policy"),
    attempts: response.headers.get("x-zml-attempts"),
  },
};

// A stream with usage, under a policy chosen by header.
const stream = await client.chat.completions.create(
  { model, messages, max_tokens: 4, stream: true, stream_options: { include_usage: true } },
  { headers: { "x-zml-policy": "amd" } },
);
const chunks = [];
for await (const chunk of stream) chunks.push(chunk);
const last = chunks[chunks.length - 1];
out.stream = {
  chunks: chunks.length,
  text: chunks.map((c) => c.choices[0]?.delta?.content ?? "").join(""),
  usage: last.usage,
  zmlRouting: last.zml_routing,
};

// Errors: an unknown policy (400) and a wrong key (401).
try {
  await client.chat.completions.create(
    { model, messages },
    { headers: { "x-zml-policy": "nope" } },
  );
  out.badPolicy = "no error";
} catch (err) {
  out.badPolicy = { status: err.status, param: err.param, code: err.code, name: err.constructor.name };
}
try {
  const wrong = new OpenAI({ baseURL, apiKey: "wrong-key", maxRetries: 0 });
  await wrong.chat.completions.create({ model, messages });
  out.badKey = "no error";
} catch (err) {
  out.badKey = { status: err.status, name: err.constructor.name };
}
console.log(JSON.stringify(out));
