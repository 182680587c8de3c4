"""The plan of a serving comparison: the systems, how each is configured alike,
the request stream (vLLM's random dataset, Poisson arrivals), the rate sweep,
and the exact command lines of the servers and of `vllm bench serve`.

Nothing here starts a process: the driver (run.py, faults.py) runs what this
builds, and --dry-run prints it.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, field

# The systems, in the order they run and are reported.
VLLM = "vllm-serve"              # `vllm serve` alone on the GPU
VLLM_MPS = "vllm-serve-mps"      # `vllm serve` as a client of a private MPS daemon
FRMPS = "frmps"                  # `frmps serve --model M` at its defaults (Go front door)
FRMPS_VLLM_FE = "frmps-vllm-frontend"  # `frmps serve --model M --frontend vllm`
SYSTEMS = [VLLM, VLLM_MPS, FRMPS, FRMPS_VLLM_FE]
VLLM_SYSTEMS = {VLLM, VLLM_MPS}
FRMPS_SYSTEMS = {FRMPS, FRMPS_VLLM_FE}
# The fault run's baseline: `vllm serve` in MPS, restarted by a supervisor loop.
VLLM_MPS_RESTART = "vllm-serve-mps-restart"
FAULT_SYSTEMS = [VLLM_MPS_RESTART, FRMPS, FRMPS_VLLM_FE]

# The trials of an frmps system again after a failover drill and its failback
# (--after-failover): system "<name>+failover".
AFTER_FAILOVER = "+failover"

SYSTEM_LABELS = {
    VLLM: "vllm serve",
    VLLM_MPS: "vllm serve in MPS",
    VLLM_MPS_RESTART: "vllm serve in MPS + restart loop",
    FRMPS: "frmps serve (Go front door)",
    FRMPS_VLLM_FE: "frmps serve --frontend vllm",
    FRMPS + AFTER_FAILOVER: "frmps serve (Go front door), after a failover",
    FRMPS_VLLM_FE + AFTER_FAILOVER: "frmps serve --frontend vllm, after a failover",
}

# The SLOs of goodput (vllm bench serve --goodput, milliseconds).
DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_TPOT_MS = 50.0
# At the systems' default batch bounds (vllm serve's 1,024 sequences on a large GPU):
# an 'inf' trial's requests, and the warm-up's.
DEFAULT_INF_PROMPTS = 512
DEFAULT_WARMUP_PROMPTS = 64

INF = math.inf


def parse_rates(spec: str) -> list[float]:
    """--rates: comma-separated requests per second, 'inf' for all at once.
    Positive, no repeats; kept in ascending order with inf last."""
    rates: list[float] = []
    for part in spec.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            r = INF if part == "inf" else float(part)
        except ValueError:
            raise ValueError(f"--rates {spec!r}: {part!r} is not a number or 'inf'") from None
        if not r > 0 or math.isnan(r):
            raise ValueError(f"--rates {spec!r}: rates must be positive")
        if r in rates:
            raise ValueError(f"--rates {spec!r}: {part} is given twice")
        rates.append(r)
    if not rates:
        raise ValueError("--rates: give at least one rate")
    return sorted(rates)


def rate_label(rate: float) -> str:
    """The rate as vllm bench serve writes it in its result ("inf", or the number)."""
    if rate == INF:
        return "inf"
    return f"{rate:g}"


def parse_systems(spec: str, allowed: list[str]) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in allowed]
    if bad or not names:
        raise ValueError(f"--systems {spec!r}: want a comma-separated subset of {', '.join(allowed)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--systems {spec!r}: a system is given twice")
    return [s for s in allowed if s in names]


@dataclass
class Stream:
    """The request stream: vLLM's random dataset (seeded token ids, lengths drawn
    uniformly in [len*(1-r), len*(1+r)]), Poisson arrivals (burstiness 1)."""

    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.5
    seed: int = 0  # trial i uses seed + i: every system gets the same stream in trial i
    trial_s: float = 20.0  # a finite rate sends rate * trial_s requests
    inf_prompts: int = 0  # requests of an 'inf' trial (0: 4 x max_num_seqs, DEFAULT_INF_PROMPTS at the defaults)
    # An 'inf' trial with at most this many requests in flight (vllm bench serve --max-concurrency): a steady state
    # at saturation instead of one burst of every request at once (0: the burst).
    inf_concurrency: int = 0
    min_prompts: int = 8
    temperature: float = 0.0

    def check(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio {self.range_ratio}: want a value in [0, 1)")
        if self.trial_s <= 0:
            raise ValueError(f"--trial-s {self.trial_s}: want a positive duration")
        if self.inf_prompts < 0 or self.min_prompts < 1:
            raise ValueError("--inf-prompts must be >= 0 and --min-prompts >= 1")
        if self.inf_concurrency < 0:
            raise ValueError(f"--inf-concurrency {self.inf_concurrency}: want 0 (one burst) or a positive bound")

    def num_prompts(self, rate: float, max_num_seqs: int) -> int:
        if rate == INF:
            return self.inf_prompts or (4 * max_num_seqs if max_num_seqs else DEFAULT_INF_PROMPTS)
        return max(self.min_prompts, int(math.ceil(rate * self.trial_s)))

    def max_output_len(self) -> int:
        return int(self.output_len * (1 + self.range_ratio))

    def max_input_len(self) -> int:
        return int(self.input_len * (1 + self.range_ratio))

    def min_output_len(self) -> int:
        """The shortest output the dataset asks for (with --ignore-eos every completed
        request must have at least this many tokens)."""
        return max(1, int(self.output_len * (1 - self.range_ratio)))


@dataclass
class Alike:
    """What every system is configured with alike: the same batch bounds and
    context length; the KV cache at each system's own default memory fraction,
    or kv_blocks blocks for all (the equal-KV run). A bound of 0 is left to each
    system's default, which is the same for all: `vllm serve`'s, which `frmps
    serve` takes for its engines (what a user of either gets without a flag)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    kv_blocks: int = 0  # 0: each system's default memory fraction

    def check(self, stream: Stream) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, or 0 for the systems' default")
        if self.kv_blocks < 0:
            raise ValueError("--kv-blocks must be >= 0")
        need = stream.max_input_len() + stream.max_output_len()
        if self.max_model_len and need > self.max_model_len:
            raise ValueError(f"the longest request ({stream.max_input_len()} + {stream.max_output_len()} tokens) "
                             f"exceeds --max-model-len {self.max_model_len}")
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("--max-num-batched-tokens must be at least --max-num-seqs")

    def vllm_flags(self) -> list[str]:
        """The bounds given (not 0) as `vllm serve` flags."""
        return [f for name, v in self.bounds() for f in (f"--{name}", str(v))]

    def _named(self) -> list[tuple[str, int]]:
        """The three bounds by their vLLM names, given or not (0)."""
        return [("max_num_seqs", self.max_num_seqs), ("max_num_batched_tokens", self.max_num_batched_tokens),
                ("max_model_len", self.max_model_len)]

    def bounds(self) -> list[tuple[str, int]]:
        return [(n.replace("_", "-"), v) for n, v in self._named() if v]

    def describe(self) -> str:
        """One line for the report."""
        given = ", ".join(f"{n} {v}" for n, v in self._named() if v)
        left = [n for n, v in self._named() if not v]
        if not left:
            return given
        return ", ".join(x for x in (given, f"{', '.join(left)} at `vllm serve`'s defaults (frmps serve takes them "
                                             "for its engines; no flag to either)") if x)

    @property
    def kv_mode(self) -> str:
        return f"equal-kv-{self.kv_blocks}" if self.kv_blocks else "default-kv"


@dataclass
class Plan:
    """Everything one run needs; command lines are built from it (see the
    methods), and it is written into the results as it was."""

    model: str  # the model directory every system loads
    frmps: str
    python: str  # interpreter that runs `vllm serve` and frmps's engines
    bench_python: str  # interpreter that runs `vllm bench serve`
    systems: list[str]
    rates: list[float]
    trials: int = 3
    stream: Stream = field(default_factory=Stream)
    alike: Alike = field(default_factory=Alike)
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    device: str = "cuda"  # cpu: a check of the harness (reference engine, no MPS), not a measurement
    served_model_name: str = ""  # the name clients send ("" : the model directory, both servers' default)
    vllm_args: list[str] = field(default_factory=list)  # more `vllm serve` flags
    frmps_args: list[str] = field(default_factory=list)  # more `frmps serve` flags
    warmup_prompts: int = 0  # a short untimed run per system before its trials (0: max_num_seqs)
    ready_timeout_s: float = 900.0
    py_spy: str = ""  # py-spy's path: one more run per system and view with the engine process sampled
    py_spy_views: list[str] = field(default_factory=lambda: ["idle"])  # profile.VIEWS keys
    py_spy_rate: float = INF  # the profile run's request rate (inf: saturation)
    after_failover: bool = False  # frmps systems: the trials again after a failover drill and its failback

    def check(self) -> None:
        if self.trials < 1:
            raise ValueError("--trials must be at least 1")
        if not self.model:
            raise ValueError("--model is required: a model directory (frmps model init <preset> --weights seeded)")
        self.stream.check()
        self.alike.check(self.stream)
        if self.slo_ttft_ms <= 0 or self.slo_tpot_ms <= 0:
            raise ValueError("the SLOs must be positive")
        if self.device == "cpu" and set(self.systems) - {FRMPS}:
            raise ValueError(f"--device cpu runs only {FRMPS} (the reference engine behind the Go front door): "
                             f"vllm serve and --frontend vllm need a GPU")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    # -- servers --------------------------------------------------------------------
    def vllm_serve_cmd(self, port: int) -> list[str]:
        """`vllm serve` with the alike settings (its own CLI entry point, as the
        `vllm` console script runs it)."""
        a = self.alike
        cmd = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.model, "--host", "127.0.0.1",
               "--port", str(port), *a.vllm_flags()]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if a.kv_blocks:
            cmd += ["--num-gpu-blocks-override", str(a.kv_blocks)]
        return cmd + list(self.vllm_args)

    def frmps_serve_cmd(self, system: str, port: int, admin: str, run_dir: str, log_dir: str) -> list[str]:
        """`frmps serve --model M` at its defaults, plus only what every system
        gets alike, where to listen and where to keep its logs."""
        a = self.alike
        cmd = [self.frmps, "serve", "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
               "--admin-addr", admin, "--run-dir", run_dir, "--engine-log-dir", log_dir, "--python", self.python]
        if a.max_model_len:
            cmd += ["--max-model-len", str(a.max_model_len)]
        cmd += [f"--engine-arg=--{n}={v}" for n, v in a.bounds() if n != "max-model-len"]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if a.kv_blocks:
            cmd += ["--num-blocks", str(a.kv_blocks)]
        if system == FRMPS_VLLM_FE:
            cmd += ["--frontend", "vllm"]
        if self.device == "cpu":
            cmd += ["--engine", "ref", "--device", "cpu", "--memory", "host-shm", "--no-mps"]
        return cmd + list(self.frmps_args)

    # -- the client -----------------------------------------------------------------
    def warmup_n(self) -> int:
        """Requests of the untimed warm-up run."""
        return self.warmup_prompts or self.alike.max_num_seqs or DEFAULT_WARMUP_PROMPTS

    def num_prompts(self, rate: float) -> int:
        return self.stream.num_prompts(rate, self.alike.max_num_seqs)

    def trial_seed(self, trial: int) -> int:
        return self.stream.seed + trial

    def bench_cmd(self, base_url: str, rate: float, trial: int, result_dir: str, result_file: str,
                  num_prompts: int | None = None, label: str = "", steady: bool = True) -> list[str]:
        """`vllm bench serve`: vLLM's own serving benchmark client, its completions
        backend streaming from /v1/completions, with per-request detail saved.
        An 'inf' run is bounded to stream.inf_concurrency requests in flight where
        set and ``steady`` (not the warm-up)."""
        s = self.stream
        n = self.num_prompts(rate) if num_prompts is None else num_prompts
        cmd = [self.bench_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
               "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
               "--model", self.model_name, "--tokenizer", self.model,
               "--dataset-name", "random", "--random-input-len", str(s.input_len),
               "--random-output-len", str(s.output_len), "--random-range-ratio", f"{s.range_ratio:g}",
               "--num-prompts", str(n), "--request-rate", rate_label(rate), "--burstiness", "1.0",
               "--seed", str(self.trial_seed(trial)), "--ignore-eos", "--temperature", f"{s.temperature:g}",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--goodput", f"ttft:{self.slo_ttft_ms:g}", f"tpot:{self.slo_tpot_ms:g}",
               "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_file,
               "--disable-tqdm"]
        if rate == INF and steady and s.inf_concurrency:
            cmd += ["--max-concurrency", str(s.inf_concurrency)]
        if label:
            cmd += ["--label", label]
        return cmd

    def warmup_cmd(self, base_url: str, result_dir: str) -> list[str]:
        n = self.warmup_n()
        return self.bench_cmd(base_url, INF, 0, result_dir, "warmup.json", num_prompts=n, label="warmup", steady=False)

    # -- the schedule ---------------------------------------------------------------
    def schedule(self) -> list[tuple[int, float]]:
        """(trial, rate) in the order a system runs them: trial by trial, every rate
        in each, so that a drift of the server over the run touches every rate alike."""
        return [(t, r) for t in range(self.trials) for r in self.rates]

    def estimate_s(self, start_s: dict[str, float] | None = None, drain_s: float = 5.0,
                   client_s: float = 4.0, import_s: float = 30.0) -> dict[str, float]:
        """A rough duration per system: its start (start_s, else 120 s on a GPU),
        a warm-up, and each trial's arrivals plus drain_s, plus client_s per
        client run (tokenizer and dataset before its first request); the first
        system also import_s, the client's one import of vLLM (client.py). An
        'inf' trial is counted as trial_s."""
        out = {}
        for i, system in enumerate(self.systems):
            t = (start_s or {}).get(system, 120.0 if self.device != "cpu" else 15.0) + drain_s * 2 + client_s
            t += import_s if i == 0 else 0.0
            trials = sum((self.stream.trial_s if rate == INF else self.num_prompts(rate) / rate) + drain_s + client_s
                         for _, rate in self.schedule())
            t += trials
            if self.after_failover and system in FRMPS_SYSTEMS:
                t += 60.0 + drain_s + client_s + trials  # the drill and its failback (a restore), a warm-up, the trials
            if self.py_spy:
                run_s = self.stream.trial_s if self.py_spy_rate == INF else self.num_prompts(self.py_spy_rate) / self.py_spy_rate
                t += (run_s + drain_s + client_s) * len(self.py_spy_views)
            out[system] = round(t)
        return out

    def to_json(self) -> dict:
        d = asdict(self)
        d["rates"] = [rate_label(r) for r in self.rates]
        return d


def shell(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
