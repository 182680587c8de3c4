#!/usr/bin/env python3
"""Real weights through `frmps serve --engine vllm`: the shared weights pool holds
the checkpoint's tensors, by checksum.

For a model directory with *.safetensors (a Qwen2/Llama-family checkpoint, one
GPU, tensor parallel size 1):

1. expected: every vLLM parameter's checksum computed from the files on the CPU
   (q/k/v and gate/up fused as vLLM fuses them, converted to the engines' dtype,
   bfloat16; vocabulary rows padded with zeros as vLLM pads them);
2. frmps: `frmps serve --engine vllm --device cuda --memory cuda-vmm --model DIR`
   with the engines' debug hooks on (FRMPS_DEBUG_POOL_CHECKSUM,
   FRMPS_DEBUG_PARAM_CHECKSUMS): the active writes its model's per-parameter
   checksums when it is ready (its parameters live in the weights pool); the
   standby, which loaded nothing (dummy weights into its placeholder), writes its
   own on SIGRTMIN+1 once it has mapped the active's pool. `frmps status`'s
   weights field must say loaded:DIR for both;
3. plain vLLM (--plain-vllm, the default): the same checksums from
   `vllm.LLM(model=DIR, dtype=bfloat16)` in a separate process (vLLM's own
   loader, no frmps);
4. negative control: a copy of the directory whose file has one element of one
   tensor changed. --negative file (default): its expected checksums must differ
   from the active's in exactly the parameter holding that tensor. --negative
   serve: also serve the copy with frmps and check its active differs from the
   original file in exactly that parameter (one more deployment, ~1 minute).

Verdict: PASS when the active, the standby and plain vLLM all equal the file for
every parameter, status says loaded for both engines, and the negative control
mismatches where (and only where) it should. Prints one line; --out gets JSON.

    PYTHONPATH=$VLSITE:$PWD/vllmpatch/src python3 bench/gpu/weights_check.py \\
        --frmps bin/frmps --model /models/Qwen2.5-0.5B-Instruct --out /tmp/weights.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "vllmpatch", "src"))
sys.path.insert(0, REPO)  # the bench package

from bench.deploy import Deployment  # noqa: E402
from bench.serve import ServeOpts  # noqa: E402
from bench.procs import field  # noqa: E402
from frmps_engine.sdk import debug_fault  # noqa: E402

DTYPE = "bfloat16"  # the vLLM engines' dtype (frmps owns it)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# -- the file's side ------------------------------------------------------------------
def file_tensors(model_dir: str) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    out[k] = st.get_tensor(k)
    if not out:
        raise SystemExit(f"{model_dir}: no *.safetensors")
    return out


def expected_param(files: dict, name: str, shape: list[int], dtype: str = DTYPE):
    """vLLM's parameter ``name`` from the file's tensors, in the engines' dtype."""
    import torch

    t = None
    for key, parts in FUSED.items():
        if f".{key}." in name:
            t = torch.cat([files[name.replace(key, p)] for p in parts])
    if t is None:
        if name == "lm_head.weight" and name not in files:
            name = "model.embed_tokens.weight"  # tied
        if name not in files:
            return None
        t = files[name]
    t = t.to(getattr(torch, dtype))
    if list(t.shape) != shape and t.dim() == len(shape) and t.shape[0] < shape[0] and list(t.shape[1:]) == shape[1:]:
        t = torch.cat([t, t.new_zeros([shape[0] - t.shape[0], *shape[1:]])])  # VocabParallelEmbedding's padding
    return t


def shape_of(checksum: str) -> list[int]:
    return [int(x) for x in checksum.split(":")[1].split("x") if x]


def expected(files: dict, engine: dict[str, str], dtype: str = DTYPE) -> dict[str, str | None]:
    out = {}
    for name, ck in engine.items():
        t = expected_param(files, name, shape_of(ck), dtype)
        out[name] = None if t is None else debug_fault.tensor_checksum(t)
    return out


def compare(got: dict[str, str], want: dict[str, str | None]) -> list[str]:
    """Names whose checksums differ (or that one side lacks)."""
    return sorted(n for n in set(got) | set(want) if got.get(n) is None or got.get(n) != want.get(n))


def perturbed_copy(model_dir: str, files: dict, out: str) -> tuple[str, str]:
    """A copy of model_dir (links, one shard rewritten) with one element of one
    tensor changed; returns (dir, the tensor's name)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = next((n for n in sorted(files) if n.endswith("mlp.down_proj.weight")), sorted(files)[0])
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(model_dir):
        src = os.path.join(model_dir, f)
        if not f.endswith(".safetensors"):
            os.symlink(src, os.path.join(out, f))
            continue
        with safe_open(src, framework="pt", device="cpu") as st:
            keys, meta = list(st.keys()), st.metadata()
        if target not in keys:
            os.symlink(src, os.path.join(out, f))
            continue
        tensors = {k: files[k].clone() for k in keys}
        flat = tensors[target].view(-1)
        flat[0] = -flat[0] if float(flat[0]) != 0.0 else 1.0  # a change whatever the dtype's resolution
        save_file(tensors, os.path.join(out, f), metadata=meta)
    return out, target


def param_of(tensor: str) -> str:
    for key, parts in FUSED.items():
        for p in parts:
            if f".{p}." in tensor:
                return tensor.replace(p, key)
    return tensor


# -- frmps ------------------------------------------------------------------------------
def records(d: str) -> list[dict]:
    out = []
    for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if f.endswith(".json"):
            with open(os.path.join(d, f)) as fh:
                out.append(json.load(fh))
    return out


def serve_checksums(args, model_dir: str, workdir: str, name: str) -> dict:
    """Start frmps on model_dir, collect the active's and the mapped standby's
    parameter checksums and the status's weights fields, stop it."""
    ck_dir = os.path.join(workdir, f"checksums-{name}")
    opts = ServeOpts(frmps=args.frmps, python=args.python, model=model_dir, engine="vllm", device="cuda",
                     memory="cuda-vmm", mps=not args.no_mps, num_blocks=args.num_blocks,
                     max_model_len=args.max_model_len,
                     env={debug_fault.CHECKSUM_ENV: "1", debug_fault.PARAM_CHECKSUM_ENV: ck_dir})
    dep = Deployment(opts, workdir, name)
    t0 = time.monotonic()
    dep.start()
    try:
        st = dep.wait_pair(timeout=args.timeout)
        up_s = time.monotonic() - t0
        eng = Deployment.engines(st)
        weights = {r: field(e, "weights", "") for r, e in eng.items()}
        standby_pid = int(field(eng["standby"], "pid", 0))
        deadline = time.monotonic() + 120
        active = standby = None
        while time.monotonic() < deadline and (active is None or standby is None):
            recs = records(ck_dir)
            active = next((r for r in recs if r["role"] == "active"), None)
            standby = next((r for r in recs if r["role"] == "standby" and r["mapped"]), None)
            if standby is None:  # ask for a record (again every 2 s until one says the pools are mapped)
                os.kill(standby_pid, debug_fault.checksum_signal())
            time.sleep(2)
        if active is None or standby is None:
            raise SystemExit(f"{name}: no parameter checksums from the {'active' if active is None else 'standby'} "
                             f"within 120 s (engine logs: {dep.log_dir})")
        return dict(active=active, standby=standby, weights=weights, up_s=round(up_s, 1), log_dir=dep.log_dir)
    finally:
        dep.stop()


PLAIN = r"""
import json, sys
from vllm import LLM
from frmps_engine.sdk.debug_fault import tensor_checksum

def checksums(worker):
    return {n: tensor_checksum(p) for n, p in worker.get_model().named_parameters()}

llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enforce_eager=True, gpu_memory_utilization=0.5,
          max_model_len=int(sys.argv[3]), seed=0)
print("CHECKSUMS " + json.dumps(llm.collective_rpc(checksums)[0]), flush=True)
"""


def plain_vllm(args, model_dir: str) -> dict[str, str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), os.path.join(REPO, "vllmpatch", "src")) if p)
    r = subprocess.run([args.python, "-c", PLAIN, model_dir, DTYPE, str(args.max_model_len)], env=env,
                       capture_output=True, text=True, timeout=args.timeout)
    for line in r.stdout.splitlines():
        if line.startswith("CHECKSUMS "):
            return json.loads(line[len("CHECKSUMS "):])
    raise SystemExit(f"plain vLLM gave no checksums (rc {r.returncode}):\n{r.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory with *.safetensors")
    ap.add_argument("--frmps", default=os.path.join(REPO, "bin", "frmps"))
    ap.add_argument("--python", default=sys.executable, help="the engines' interpreter (vLLM importable)")
    ap.add_argument("--out", required=True, help="JSON result")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--no-mps", action="store_true", help="frmps serve --no-mps")
    ap.add_argument("--plain-vllm", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare with vllm.LLM(model=DIR) in a separate process")
    ap.add_argument("--negative", choices=["file", "serve"], default="file")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--workdir", help="logs and the perturbed copy (default: a temporary directory, kept)")
    args = ap.parse_args()
    model = os.path.abspath(args.model)
    workdir = args.workdir or tempfile.mkdtemp(prefix="frmps-weights-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.monotonic()
    res: dict = {"model": model, "dtype": DTYPE, "workdir": workdir}

    files = file_tensors(model)
    got = serve_checksums(args, model, workdir, "real")
    act, sb = got["active"]["params"], got["standby"]["params"]
    want = expected(files, act)
    res.update(up_s=got["up_s"], status_weights=got["weights"], params=len(act),
               active_vs_file=compare(act, want), standby_vs_file=compare(sb, want),
               standby_vs_active=compare(sb, act), engine_logs=got["log_dir"],
               hello_weights={r: got[r]["weights"] for r in ("active", "standby")})
    if args.plain_vllm:
        plain = plain_vllm(args, model)
        res["plain_vs_file"], res["plain_vs_active"] = compare(plain, want), compare(plain, act)

    bad_dir, tensor = perturbed_copy(model, files, os.path.join(workdir, "perturbed"))
    res["negative"] = {"mode": args.negative, "perturbed_tensor": tensor, "param": param_of(tensor)}
    bad_want = expected(file_tensors(bad_dir), act)
    res["negative"]["active_vs_perturbed_file"] = compare(act, bad_want)
    if args.negative == "serve":
        bad = serve_checksums(args, bad_dir, workdir, "perturbed")
        res["negative"]["perturbed_active_vs_file"] = compare(bad["active"]["params"], want)
        res["negative"]["perturbed_standby_vs_file"] = compare(bad["standby"]["params"], want)

    loaded = f"loaded:{model}"
    one = [param_of(tensor)]
    checks = {
        "status says loaded (both engines)": set(got["weights"].values()) == {loaded},
        "active == file": not res["active_vs_file"] and res["params"] > 0,
        "standby (mapped) == file": not res["standby_vs_file"],
        "plain vLLM == file": (not res["plain_vs_file"]) if args.plain_vllm else None,
        "negative control mismatches exactly the perturbed parameter": (
            res["negative"]["active_vs_perturbed_file"] == one
            and (args.negative == "file" or (res["negative"]["perturbed_active_vs_file"] == one
                                             and res["negative"]["perturbed_standby_vs_file"] == one))),
    }
    res["checks"] = checks
    ok = all(v for v in checks.values() if v is not None)
    res["verdict"] = "PASS" if ok else "FAIL"
    res["seconds"] = round(time.monotonic() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    failed = [k for k, v in checks.items() if v is False]
    print(f"weights_check {res['verdict']}: {res['params']} parameters of {model}: active, mapped standby"
          f"{', plain vLLM' if args.plain_vllm else ''} {'equal' if ok else 'vs'} the file"
          f"{'' if ok else ' — failed: ' + '; '.join(failed)}; negative control ({args.negative}) "
          f"mismatched {res['negative']['active_vs_perturbed_file'][:3]}; {res['seconds']} s; {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
