// llama.cpp (node-llama-cpp's prebuilt CPU binary) on a GGUF: greedy decode tok/s of one prompt.
import {getLlama, LlamaChatSession} from "node-llama-cpp";
const [model, prompt, n, threads] = [process.argv[2], process.argv[3], +(process.argv[4] || 128), +(process.argv[5] || 2)];
const llama = await getLlama({gpu: false, build: "never"});
const m = await llama.loadModel({modelPath: model});
const ctx = await m.createContext({contextSize: 1024, threads});
const seq = ctx.getSequence();
const toks = m.tokenize(prompt);
let count = 0, t1 = 0;
const t0 = performance.now();
for await (const tok of seq.evaluate(toks, {temperature: 0})) {
  if (count === 0) t1 = performance.now();
  if (++count >= n) break;
}
const t2 = performance.now();
console.log(JSON.stringify({engine: "llama.cpp (node-llama-cpp 3.22.1)",
  threads, prompt_tokens: toks.length, decode_tokens: count - 1, first_token_s: (t1 - t0) / 1000,
  decode_tok_s: (count - 1) / ((t2 - t1) / 1000)}));
process.exit(0);
