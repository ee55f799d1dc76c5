#!/usr/bin/env python3
"""Speculative decoding and adaptive threads (issue 26): edgellm against llama.cpp's own tools.

    EDGELLM_LLAMA_TOOLS=$(scripts/build_llama_tools.sh) .venv/bin/python scripts/bench_speculative.py \
        --model smollm2-135m-instruct --rounds 3 [--draft-target T --draft-model D] [--json out.json]

Part 1, six prompts (two rewrites of given code, a summary quoting a given
passage, an answer from a given document, two open-ended), temperature 0,
the same --tokens and --threads everywhere, rounds interleaved:
  * `edgellm chat --draft ngram` and `edgellm chat --flash-attn on` (no
    drafts: the baseline and the reply it must equal token for token),
  * llama-server with no speculation and with each `--spec-type`, a fresh
    server per round (edgellm chat is a fresh process each time too; a warm
    ngram-mod table would hold the previous round's reply of the same
    prompt: --server-warm keeps servers up to show that case;
  --server-invariant runs them with edgellm's small-batch rounding, so
  both sides reply with the same text and a ratio compares drafting alone).
  Reported: medians of tokens/s, drafted/accepted, ratios to llama-server's
  best spec type (grounded prompts, goal >= 1.10x) and to edgellm without
  drafts (open-ended, goal >= 0.97x), and whether the replies were identical.
Part 2 (--draft-target/--draft-model): a draft model, edgellm `--draft MODEL`
  vs llama-server `-md`, acceptance reported.
Part 3 (unless --skip-busy): tg with one core kept busy by a spinning process,
  and idle: edgellm chat with its default (adaptive) threads, --threads 1..N,
  and llama-completion with its default threads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _bench_common import chat_cmd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CODE_A = """import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    items: list
    shipping: float


def total_price(order, tax_rate):
    subtotal = 0.0
    for item in order.items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return round(subtotal + tax + order.shipping, 2)


def cheapest_item(order):
    best = None
    for item in order.items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best


def load_orders(path):
    with open(path) as f:
        data = json.load(f)
    orders = []
    for row in data:
        orders.append(Order(row["id"], row["items"], row.get("shipping", 0.0)))
    return orders


def report(orders, tax_rate):
    lines = []
    for order in orders:
        total = total_price(order, tax_rate)
        item = cheapest_item(order)
        name = item["name"] if item else "-"
        lines.append(f"{order.order_id}: total {total}, cheapest {name}")
    return "\\n".join(lines)
"""
CODE_B = '''def parse_size(text):
    """'512M' or '4G' -> bytes."""
    text = text.strip().upper()
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human_size(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000


class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.entries = {}
        self.order = []

    def get(self, key):
        if key in self.entries:
            self.order.remove(key)
            self.order.append(key)
            return self.entries[key]
        return None

    def put(self, key, value):
        if key in self.entries:
            self.order.remove(key)
        elif len(self.entries) >= self.capacity:
            oldest = self.order.pop(0)
            del self.entries[oldest]
        self.entries[key] = value
        self.order.append(key)
'''
PASSAGE = (
    "The lighthouse on the northern cape was built in 1821 from granite quarried on the island. For a century "
    "its lamp burned whale oil, then paraffin, and from 1923 electricity brought by a cable laid across the strait. "
    "Its keepers wrote in the log every night, and one entry, by Ada Moss in the winter of 1887, is quoted in every "
    'history of the coast: "The light is lit, the sea is high, and no ship will be lost tonight while I can climb '
    'these stairs." In 1921 a storm broke the great lens; the town raised the money in a month and rebuilt it in a '
    "single summer. The light was automated in 1986, and the keeper's house is now a museum."
)
DOCUMENT = (
    "Product manual, model K-200 kettle. Capacity: 1.7 litres. Power: 2200 watts. The kettle switches off "
    "automatically when the water boils or when it is lifted from its base. Descale it every month in hard-water "
    "areas: fill it with equal parts of water and white vinegar, leave it for one hour, then boil and rinse twice. "
    "Never immerse the base in water. The warranty lasts two years from the date of purchase and does not cover "
    "damage caused by limescale. To register the warranty, send the serial number printed under the base to "
    "support@example.com within 30 days of purchase."
)
PROMPTS = {
    "rewrite-a": (
        "grounded",
        "Rewrite this Python module with the variable `order` renamed to `purchase` everywhere. "
        "Output only the code.\n\n" + CODE_A,
    ),
    "rewrite-b": (
        "grounded",
        "Add a docstring to the class Cache in this code and output the whole code unchanged otherwise. "
        "Output only the code.\n\n" + CODE_B,
    ),
    "summary": (
        "grounded",
        "Summarize this passage in a few sentences, quoting Ada Moss's log entry word for word:\n\n" + PASSAGE,
    ),
    "document": (
        "grounded",
        "Using only this document, explain how to descale the kettle and what the warranty covers, "
        "quoting the document where you can.\n\n" + DOCUMENT,
    ),
    "story": ("open", "Write a short story about a fox who learns to sail."),
    "explain": ("open", "Explain to a child why the sky is blue and why sunsets are red."),
}
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
BUSY_PROMPT = "Write a long story about a dragon who guards a library."


def tools_dir() -> Path:
    d = os.environ.get("EDGELLM_LLAMA_TOOLS")
    if not d:
        d = subprocess.run(
            [str(ROOT / "scripts" / "build_llama_tools.sh")], capture_output=True, text=True, check=True
        ).stdout.strip()
    return Path(d)


def model_path(ref: str) -> Path:
    from edgellm.models.resolve import resolve

    return resolve(ref).path


def edgellm_chat(path: Path, prompt: str, tokens: int, *extra: str) -> dict:
    cmd = chat_cmd(path, prompt, tokens, "--ctx", "4096", "--no-history", "--json", *extra)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"error: edgellm chat failed: {p.stderr.strip()[-600:]}")
    j = json.loads(p.stdout)
    st = j["stats"]
    return {
        "tps": st["tokens_per_second"],
        "n": st["generated_tokens"],
        "drafted": st["draft_tokens"],
        "accepted": st["draft_accepted"],
        "steps": st["draft_steps"],
        "threads": st["threads"],
        "text": j["reply"],
    }


class Server:
    """One llama-server on a free port, started for a spec type (or none) and stopped after."""

    def __init__(self, exe: Path, path: Path, threads: int, spec: str | None, draft: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [
            str(exe),
            "-m",
            str(path),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            "4096",
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "-np",
            "1",
        ]
        if spec:
            cmd += ["--spec-type", spec]
        if draft is not None:
            # -md alone only loads the model: this llama.cpp infers a draft type from the GGUF (MTP heads,
            # DFlash) and speculates with none for a plain model; draft-simple is its classic draft model
            cmd += ["--spec-type", "draft-simple", "-md", str(draft)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    sys.exit(f"error: llama-server {spec or ''} exited ({self.proc.returncode}): {' '.join(cmd)}")
            time.sleep(0.3)
        sys.exit("error: llama-server did not become healthy")

    def chat(self, prompt: str, tokens: int) -> dict:
        # cache_prompt off: each prompt is computed fresh, as `edgellm chat` (a fresh process) computes it;
        # with it on, the cells of the template's opening came from the prompt answered before, computed in
        # other batches, and the reply at temperature 0 changed with the order of the prompts
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": tokens,
                "seed": 0,
                "cache_prompt": False,
            }
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            j = json.load(r)
        t = j.get("timings", {})
        return {
            "tps": t.get("predicted_per_second", 0.0),
            "n": t.get("predicted_n", 0),
            "drafted": t.get("draft_n", 0),
            "accepted": t.get("draft_n_accepted", 0),
            "text": j["choices"][0]["message"]["content"],
        }

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows]
    return statistics.median(vals) if vals else 0.0


# long: one benchmark read top to bottom: the interleaved rounds, then the table
def part_prompts(a, path: Path, exe: Path) -> dict:
    names = [n for n in PROMPTS if not a.prompts or n in a.prompts.split(",")]
    spec_types = [s for s in a.spec_types.split(",") if s]
    res: dict = {n: {"edgellm-ngram": [], "edgellm-off": [], **{f"server-{s}": [] for s in ["none", *spec_types]}} for n in names}
    identical: dict = {n: [] for n in names}
    servers: dict = {}
    for rnd in range(a.rounds):
        print(f"round {rnd + 1}/{a.rounds}", file=sys.stderr)
        if not a.server_warm or not servers:
            for s in servers.values():
                s.close()
            servers = {s: Server(exe, path, a.threads, None if s == "none" else s) for s in ["none", *spec_types]}
        order = list(names) if rnd % 2 == 0 else list(reversed(names))
        for n in order:
            prompt = PROMPTS[n][1]
            off = edgellm_chat(path, prompt, a.tokens, "--threads", str(a.threads), "--flash-attn", "on")
            spec = edgellm_chat(path, prompt, a.tokens, "--threads", str(a.threads), "--draft", "ngram")
            res[n]["edgellm-off"].append(off)
            res[n]["edgellm-ngram"].append(spec)
            identical[n].append(off["text"] == spec["text"] and off["n"] == spec["n"])
            for s, srv in servers.items():
                res[n][f"server-{s}"].append(srv.chat(prompt, a.tokens))
            print(
                f"  {n}: edgellm {off['tps']:.1f} -> {spec['tps']:.1f} t/s (drafted {spec['drafted']}, accepted {spec['accepted']}); "
                + ", ".join(f"{s} {res[n][f'server-{s}'][-1]['tps']:.1f}" for s in servers),
                file=sys.stderr,
            )
    for s in servers.values():
        s.close()
    print(f"\n## Six prompts: {path.name}, {a.threads} threads, temperature 0, {a.tokens} tokens, medians of {a.rounds} rounds\n")
    cols = ["edgellm-off", "edgellm-ngram", "server-none", *[f"server-{s}" for s in spec_types]]
    print(
        "| prompt | kind | " + " | ".join(cols) + " | ngram drafted/accepted | vs best server spec | vs edgellm off | identical |"
    )
    print("|" + "---|" * (len(cols) + 6))
    summary = {}
    for n in names:
        kind = PROMPTS[n][0]
        m = {c: med(res[n][c], "tps") for c in cols}
        best_spec = max((c for c in cols if c.startswith("server-") and c != "server-none"), key=lambda c: m[c], default=None)
        r_srv = m["edgellm-ngram"] / m[best_spec] if best_spec and m[best_spec] else 0.0
        r_off = m["edgellm-ngram"] / m["edgellm-off"] if m["edgellm-off"] else 0.0
        d, acc = med(res[n]["edgellm-ngram"], "drafted"), med(res[n]["edgellm-ngram"], "accepted")
        goal = (r_srv >= 1.10) if kind == "grounded" else (r_off >= 0.97)
        print(
            f"| {n} | {kind} | "
            + " | ".join(f"{m[c]:.1f}" for c in cols)
            + f" | {d:.0f}/{acc:.0f} | {r_srv:.2f}x ({best_spec}) | {r_off:.2f}x | {all(identical[n])} |"
            + ("" if goal else " goal not met")
        )
        summary[n] = {
            "kind": kind,
            "medians": m,
            "best_server_spec": best_spec,
            "ratio_vs_best_server": r_srv,
            "ratio_vs_edgellm_off": r_off,
            "identical": identical[n],
            # the same text as llama-server's (without speculation)? Otherwise the ratios compare two replies
            "same_text_as_server": [
                o["text"] == v["text"] for o, v in zip(res[n]["edgellm-off"], res[n]["server-none"], strict=True)
            ],
            "runs": res[n],
        }
        same = summary[n]["same_text_as_server"]
        print(f"  {n}: edgellm's reply is llama-server's in {sum(same)} of {len(same)} rounds", file=sys.stderr)
    return summary


def part_draft_model(a, exe: Path) -> dict:
    target, draft = model_path(a.draft_target), model_path(a.draft_model)
    prompt = PROMPTS["summary"][1]
    rows: dict = {"edgellm": [], "server": []}
    for rnd in range(a.rounds):
        rows["edgellm"].append(edgellm_chat(target, prompt, a.tokens, "--threads", str(a.threads), "--draft", str(draft)))
        srv = Server(exe, target, a.threads, None, draft=draft)
        try:
            rows["server"].append(srv.chat(prompt, a.tokens))
        finally:
            srv.close()
    e, s = med(rows["edgellm"], "tps"), med(rows["server"], "tps")
    print(f"\n## Draft model: {draft.name} drafting for {target.name}\n")
    print("| side | tokens/s | drafted | accepted | acceptance |\n|---|---|---|---|---|")
    for side, v in (("edgellm --draft MODEL", rows["edgellm"]), ("llama-server -md", rows["server"])):
        d, acc = med(v, "drafted"), med(v, "accepted")
        print(f"| {side} | {med(v, 'tps'):.1f} | {d:.0f} | {acc:.0f} | {acc / d if d else 0:.2f} |")
    print(f"\nratio {e / s if s else 0:.2f}x (goal >= 1.0x)")
    return {"runs": rows, "ratio": e / s if s else 0.0}


def completion_tps(exe: Path, path: Path, tokens: int) -> float:
    p = subprocess.run(
        [
            str(exe),
            "-m",
            str(path),
            "-p",
            BUSY_PROMPT,
            "-n",
            str(tokens),
            "--temp",
            "0",
            "-c",
            "4096",
            "--no-display-prompt",
            "-no-cnv",
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", p.stderr)
    if p.returncode != 0 or not ev:
        sys.exit(f"error: llama-completion failed: {p.stderr.strip()[-500:]}")
    return int(ev.group(2)) / (float(ev.group(1)) / 1000.0)


def part_busy(a, path: Path, exe_completion: Path) -> dict:
    cores = a.threads
    out: dict = {}
    for scenario in ("busy", "idle"):
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if scenario == "busy" else None
        try:
            time.sleep(1.0)
            rows: dict = {
                "edgellm-adaptive": [],
                "llama-completion-default": [],
                **{f"edgellm-t{t}": [] for t in range(1, cores + 1)},
            }
            for _ in range(a.rounds):
                rows["edgellm-adaptive"].append(edgellm_chat(path, BUSY_PROMPT, a.busy_tokens)["tps"])
                rows["llama-completion-default"].append(completion_tps(exe_completion, path, a.busy_tokens))
                for t in range(1, cores + 1):
                    rows[f"edgellm-t{t}"].append(edgellm_chat(path, BUSY_PROMPT, a.busy_tokens, "--threads", str(t))["tps"])
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
        m = {k: statistics.median(v) for k, v in rows.items()}
        best_fixed = max(v for k, v in m.items() if k.startswith("edgellm-t"))
        out[scenario] = {
            "medians": m,
            "vs_llama_completion": m["edgellm-adaptive"] / m["llama-completion-default"],
            "vs_best_fixed": m["edgellm-adaptive"] / best_fixed,
            "runs": rows,
        }
    print(
        f"\n## Threads: tg of {a.busy_tokens} tokens, one core kept busy by a spinning process vs idle, medians of {a.rounds}\n"
    )
    print("| scenario | " + " | ".join(out["busy"]["medians"]) + " | adaptive / llama-completion | adaptive / best fixed |")
    print("|" + "---|" * (len(out["busy"]["medians"]) + 3))
    for sc, v in out.items():
        print(
            f"| {sc} | "
            + " | ".join(f"{x:.1f}" for x in v["medians"].values())
            + f" | {v['vs_llama_completion']:.2f}x | {v['vs_best_fixed']:.2f}x |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="", help="comma-separated subset of: " + ",".join(PROMPTS))
    ap.add_argument("--spec-types", default=",".join(SPEC_TYPES))
    ap.add_argument(
        "--server-warm",
        action="store_true",
        help="keep each llama-server up across rounds (its n-gram table then holds earlier replies)",
    )
    ap.add_argument(
        "--server-invariant",
        action="store_true",
        help="run llama.cpp's tools with edgellm's small-batch rounding (GGML_CPU_SMALL_BATCH_INVARIANT, "
        "scripts/patches): both sides then reply with the same text, so a ratio compares drafting alone",
    )
    ap.add_argument("--draft-target", help="part 2: the target model (e.g. the 1.93B widened model at Q8_0)")
    ap.add_argument("--draft-model", help="part 2: its draft model (e.g. the default model at Q4_0)")
    ap.add_argument("--skip-prompts", action="store_true", help="skip part 1 (the six prompts)")
    ap.add_argument("--skip-busy", action="store_true")
    ap.add_argument("--busy-tokens", type=int, default=128)
    ap.add_argument("--json", dest="json_out", help="write every run here")
    a = ap.parse_args()
    if a.server_invariant:  # inherited by every llama-server and llama-completion this script starts
        from edgellm.engine.speculative import FA_TILE

        os.environ["GGML_CPU_SMALL_BATCH_INVARIANT"] = str(FA_TILE)
    tools = tools_dir()
    path = model_path(a.model)
    result: dict = {
        "model": str(path),
        "threads": a.threads,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "server_invariant": a.server_invariant,
    }

    def save() -> None:  # after each part: a later part's failure keeps what was measured
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(result, indent=1))

    if not a.skip_prompts:
        result["prompts"] = part_prompts(a, path, tools / "llama-server")
        save()
    if a.draft_target and a.draft_model:
        result["draft_model"] = part_draft_model(a, tools / "llama-server")
        save()
    if not a.skip_busy:
        result["threads_busy"] = part_busy(a, path, tools / "llama-completion")
        save()


if __name__ == "__main__":
    main()
