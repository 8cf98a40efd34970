"""A stand-in for `python -m vllm.entrypoints.openai.api_server` in the launcher's tests: the same command line
(--model, --host, --port, other flags ignored), vLLM's answer form (choices[0].token_ids, "token_id:N" logprob
keys, usage.prompt_tokens_details, /v1/models id/root/max_model_len), answered by the fp64 oracle of --model (greedy).

$FAKE_VLLM_MODE misbehaves: "exit" (exit 3 at start-up, after a log line), "hang" (never listens), "die_once:K"
(the process exits with code 9 at its K-th completion, once per marker file $FAKE_VLLM_MARKER), "deaf_once:K" (its
K-th completion answers HTTP 500 and the process stops listening but stays alive, once per marker), "slow:S" (every
completion waits S seconds first).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    mode = os.environ.get("FAKE_VLLM_MODE", "good")
    print(f"fake vLLM server: model {args.model}, mode {mode}", flush=True)
    if mode == "exit":
        print("ValueError: this model cannot be served (fake)", flush=True)
        sys.exit(3)
    if mode == "hang":
        time.sleep(3600)
    import oracle
    import torch
    model = oracle.load(args.model)
    vocab = model.config.vocab_size
    served = {"n": 0}
    lock = threading.Lock()

    def complete(body: dict) -> dict:
        with lock:
            served["n"] += 1
            n_done = served["n"]
        if mode.startswith("die_once:") and n_done >= int(mode.split(":")[1]):
            marker = os.environ["FAKE_VLLM_MARKER"]
            if not os.path.exists(marker):
                open(marker, "w").close()
                print("RuntimeError: engine core died (fake)", flush=True)
                os._exit(9)
        if mode.startswith("deaf_once:") and n_done >= int(mode.split(":")[1]):
            marker = os.environ["FAKE_VLLM_MARKER"]
            if not os.path.exists(marker):
                open(marker, "w").close()
                print("EngineDeadError: engine core died (fake); the API server stays up, deaf", flush=True)
                threading.Thread(target=srv.shutdown, daemon=True).start()
                return {"error": {"message": "EngineCore encountered an issue (fake)", "code": 500}, "_status": 500}
        if mode.startswith("slow:"):
            time.sleep(float(mode.split(":")[1]))
        prompt, n, k = body["prompt"], body["max_tokens"], body.get("logprobs") or 0
        logits, state = model.prefill([min(t, vocab - 1) for t in prompt])
        row = logits[-1]
        toks, tops, lps = [], [], []
        for _ in range(n):
            lp = torch.log_softmax(row.double(), -1)
            t = int(torch.argmax(row))
            top = torch.topk(lp, min(k, vocab))
            toks.append(t)
            lps.append(float(lp[t]))
            tops.append({f"token_id:{int(j)}": float(v) for v, j in zip(top.values, top.indices)})
            row, state = model.decode(t, state)
        return {"choices": [{"index": 0, "text": "", "finish_reason": "length", "token_ids": toks,
                             "logprobs": {"tokens": [f"token_id:{t}" for t in toks], "token_logprobs": lps,
                                          "top_logprobs": tops} if k else None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                          "prompt_tokens_details": {"cached_tokens": 0}}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, payload: dict) -> None:
            status = payload.pop("_status", 200)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply({"object": "list", "data": [{"id": args.model, "object": "model", "root": args.model,
                                                    "max_model_len": 4096}]})

        def do_POST(self):
            self.reply(complete(json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

    srv = ThreadingHTTPServer((args.host, args.port), Handler)
    print("Application startup complete.", flush=True)
    srv.serve_forever()
    srv.server_close()              # deaf: the port closed, the process alive
    time.sleep(3600)


if __name__ == "__main__":
    main()
