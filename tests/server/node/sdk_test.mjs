// The official OpenAI Node SDK against a running `decodelab serve` (BASE_URL, API_KEY from the
// environment): completions, chat and streaming, with real assertions on shapes and token counts.
import assert from "node:assert/strict";
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY, maxRetries: 0 });

const models = await client.models.list();
const model = models.data[0].id;
assert.ok(model, "a model id in /v1/models");

const prompt = [41, 97, 150, 203, 256, 309, 362, 415];
const done = await client.completions.create({
  model, prompt, max_tokens: 7, temperature: 0, ignore_eos: true,
});
assert.equal(done.object, "text_completion");
assert.equal(done.choices[0].finish_reason, "length");
assert.equal(done.usage.completion_tokens, 7);
assert.equal(done.usage.prompt_tokens, prompt.length);
assert.equal(done.usage.prompt_tokens_details.cached_tokens, 0);

// Streaming completions: one token per chunk, same ids and text as the non-streamed call.
const stream = await client.completions.create({
  model, prompt, max_tokens: 7, temperature: 0, ignore_eos: true, stream: true,
  stream_options: { include_usage: true },
});
let text = "", chunks = 0, usage = null, ids = [];
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  if (chunk.choices.length === 0) continue;
  chunks += 1;
  text += chunk.choices[0].text;
  ids.push(...chunk.choices[0].token_ids);
}
assert.equal(chunks, 7);
assert.equal(text, done.choices[0].text);
assert.deepEqual(ids, done.choices[0].token_ids);
assert.equal(usage.completion_tokens, 7);

// Chat, plain and streamed.
const messages = [{ role: "system", content: "Be brief." }, { role: "user", content: "Hello!" }];
const chat = await client.chat.completions.create({
  model, messages, max_completion_tokens: 5, temperature: 0, ignore_eos: true,
});
assert.equal(chat.object, "chat.completion");
assert.equal(chat.choices[0].message.role, "assistant");
assert.equal(chat.usage.completion_tokens, 5);
const chatStream = await client.chat.completions.create({
  model, messages, max_completion_tokens: 5, temperature: 0, ignore_eos: true, stream: true,
});
let content = "", finish = null;
for await (const chunk of chatStream) {
  content += chunk.choices[0]?.delta?.content ?? "";
  finish = chunk.choices[0]?.finish_reason ?? finish;
}
assert.equal(content, chat.choices[0].message.content);
assert.equal(finish, "length");

// Errors surface as the SDK's typed errors with our envelope.
await assert.rejects(
  client.completions.create({ model, prompt: [], max_tokens: 1 }),
  (e) => e.status === 400 && typeof e.message === "string");
await assert.rejects(
  client.completions.create({ model: "no-such-model", prompt, max_tokens: 1 }),
  (e) => e.status === 404);
const bad = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: "wrong", maxRetries: 0 });
await assert.rejects(bad.models.list(), (e) => e.status === 401);

console.log("openai-node SDK test: completions, streaming, chat and errors OK");
