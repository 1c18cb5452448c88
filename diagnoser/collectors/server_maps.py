"""What each serving engine's /metrics page calls the numbers a diagnosis reads: one table per engine.

Names are written as the engines register them (vLLM's v1 metrics loggers and its V0 names still in the field,
SGLang's metrics collector, TGI's router, Triton's core and TensorRT-LLM backend metrics, NVIDIA NIM's documented
table, llama.cpp's server). Counters carry the `_total` suffix prometheus_client adds on exposition. A name may
select one label value, `family{label="value"}` (Triton's TensorRT-LLM backend puts several gauges in one family).

A signal lists its sources in order of preference; the first one the page has is used. Kinds of source:
- Gauge: the value at each scrape, summed over label sets (engines, DP ranks), or averaged for ratios;
- Rate: a counter's per-second increase between scrapes;
- StepRatio: the ratio of two counters' increases between scrapes (generated tokens per engine step);
- GaugeRatio: the ratio of two gauges at each scrape (used KV blocks / all KV blocks);
- WindowRatio: the ratio of two counters' increases over the whole window, one value (prefix-cache hits / queries).
Histograms give, per key, the window's p50, p99 and mean (signals server.KEY_p50[_s], _p99[_s], _mean[_s]).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from diagnoser import signals as S


def _absent(reasons: dict[S.Sig, str]) -> dict[str, str]:
    """Why a server never reports a signal, keyed by plain names (lookups come with the names a capture holds)."""
    return {str(k): v for k, v in reasons.items()}


@dataclass(frozen=True)
class Gauge:
    specs: tuple[str, ...]
    mean: bool = False  # a ratio: averaged over label sets, not summed
    positive: bool = False  # a value <= 0 means "not in use" (SGLang reports spec acceptance 0 without a draft)
    # A 0..1 ratio that some releases export as a percent (SGLang's cache_hit_rate read 87.75): above 1, it is one.
    percent_above_one: bool = False


@dataclass(frozen=True)
class Rate:
    specs: tuple[str, ...]
    moving: bool = False  # a counter that never moved is "not measured" (vLLM's FLOP estimates on its CPU build)


@dataclass(frozen=True)
class StepRatio:
    num: tuple[str, ...]
    den: tuple[str, ...]


@dataclass(frozen=True)
class GaugeRatio:
    num: str
    den: str


@dataclass(frozen=True)
class WindowRatio:
    # (numerator specs summed, denominator specs summed), first pair the page has wins
    pairs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
    plus: float = 0.0  # added to the ratio (vLLM's mean acceptance length counts the bonus token)
    scale: float = 1.0  # unit conversion (Triton's cumulative microseconds)


Source = Gauge | Rate | StepRatio | GaugeRatio | WindowRatio


@dataclass(frozen=True)
class Hist:
    bases: tuple[str, ...]  # histogram base names (or summaries), first present wins
    scale: float = 1.0  # to seconds / tokens (Triton's first-response histogram is in ms)


@dataclass(frozen=True)
class HistKey:
    key: str
    unit: str  # "s" or "tokens" or "requests"
    meaning: str


# Histogram keys, the unit of their signals and what they measure. Signals: server.{key}_{p50,p99,mean}{_s if s}.
HIST_KEYS: tuple[HistKey, ...] = (
    HistKey("ttft", "s", "time to first token"),
    HistKey("itl", "s", "inter-token latency"),
    HistKey("tpot", "s", "per request, mean time per output token"),
    HistKey("queue_time", "s", "per request, time waiting to be scheduled"),
    HistKey("prefill_time", "s", "per request, time in prefill"),
    HistKey("prefill_time_per_token", "s", "per request, prefill time per prompt token"),
    HistKey("decode_time", "s", "per request, time in decode"),
    HistKey("inference_time", "s", "per request, time running (prefill + decode)"),
    HistKey("e2e", "s", "per request, end-to-end latency"),
    HistKey("prefill_step", "s", "one prefill forward pass of a batch"),
    HistKey("decode_step", "s", "one decode forward pass of a batch"),
    HistKey("prompt_len", "tokens", "prompt tokens per request"),
    HistKey("gen_len", "tokens", "generated tokens per request"),
    HistKey("max_tokens", "tokens", "the max_tokens (max_new_tokens) requests asked for"),
    HistKey("max_gen_len", "tokens", "per request, the most tokens any of its n sequences generated"),
    HistKey("params_n", "sequences", "the n (parallel sequences) requests asked for"),
    HistKey("iteration_tokens", "tokens", "tokens per engine step (prefill + decode)"),
)
HIST_UNITS = {h.key: h.unit for h in HIST_KEYS}


def hist_signal(key: str, stat: str) -> str:
    """server.ttft_p50_s, server.prompt_len_mean, ..."""
    return f"server.{key}_{stat}" + ("_s" if HIST_UNITS[key] == "s" else "")


@dataclass(frozen=True)
class ServerMap:
    kind: str
    label: str
    prefixes: tuple[str, ...]  # a page whose names start so is this engine's
    signals: dict[str, tuple[Source, ...]] = field(default_factory=dict)
    histograms: dict[str, Hist] = field(default_factory=dict)
    # spelling -> canonical prefix (SGLang behind some routers and exporters writes sglang_ for sglang:; older
    # releases' names for the same family and labels)
    aliases: tuple[tuple[str, str], ...] = ()
    # signal -> why this engine does not expose it
    absent: dict[str, str] = field(default_factory=dict)
    # signal -> why it is missing when no page name starts with `backend_prefixes` (Triton without TensorRT-LLM);
    # with the backend on the page, what the page lacks is said instead
    absent_without_backend: dict[str, str] = field(default_factory=dict)
    backend_prefixes: tuple[str, ...] = ()
    # names read only for the serving configuration (info gauges and constants)
    config_names: tuple[str, ...] = ()

    def names(self, *, histograms: bool = True) -> tuple[str, ...]:
        """Metric names the mapping reads (line prefixes, canonical and alias spellings); without histograms the
        cheap per-scrape set."""
        out: list[str] = []
        for sources in self.signals.values():
            for src in sources:
                out.extend(_source_names(src))
        if histograms:
            for h in self.histograms.values():
                out.extend(h.bases)
            out.extend(self.config_names)
        bare = [spec_name(n) for n in out]
        for alt, canonical in self.aliases:
            bare += [alt + n[len(canonical):] for n in bare if n.startswith(canonical)]
        return tuple(dict.fromkeys(bare))


def _source_names(src: Source) -> list[str]:
    if isinstance(src, (Gauge, Rate)):
        return list(src.specs)
    if isinstance(src, StepRatio):
        return [*src.num, *src.den]
    if isinstance(src, GaugeRatio):
        return [src.num, src.den]
    return [n for num, den in src.pairs for n in (*num, *den)]


_SPEC = re.compile(r'^(?P<name>[^{]+)(?:\{(?P<body>[^}]*)\})?$')
_MATCHER = re.compile(r'\s*(?P<label>[a-zA-Z_]\w*)(?P<op>=|!=|=~|!~)"(?P<value>[^"]*)"\s*(?:,|$)')


@dataclass(frozen=True)
class LabelMatch:
    """A spec's label matchers, as PromQL writes them: = and != compare, =~ and !~ match the whole value; `also`
    holds the matchers after the first, all of which must match too."""

    label: str
    op: str
    value: str
    also: tuple[LabelMatch, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        got = labels.get(self.label, "")
        if self.op in ("=", "!="):
            ok = (got == self.value) is (self.op == "=")
        else:
            ok = (re.fullmatch(self.value, got) is not None) is (self.op == "=~")
        return ok and all(m.matches(labels) for m in self.also)


def spec_name(spec: str) -> str:
    m = _SPEC.match(spec)
    return m.group("name") if m else spec


def parse_spec(spec: str) -> tuple[str, LabelMatch | None]:
    """'family{label="v"}' -> ('family', LabelMatch('label', '=', 'v')); 'family{a="x",b=~"y"}' -> the first
    matcher with the second in `also`; 'name' -> ('name', None)."""
    m = _SPEC.match(spec)
    if m is None:
        return spec, None
    body = m.group("body")
    if not body:
        return m.group("name"), None
    found = [LabelMatch(x.group("label"), x.group("op"), x.group("value")) for x in _MATCHER.finditer(body)]
    if not found:
        return spec, None
    return m.group("name"), LabelMatch(found[0].label, found[0].op, found[0].value, tuple(found[1:]))


# --- vLLM (V1 names first, then the V0 and pre-0.9 names still in the field) -------------------------------------

_V = "vllm:"
_VLLM_SIGNALS: dict[str, tuple[Source, ...]] = {
    S.SERVER_RUNNING: (Gauge((_V + "num_requests_running",)),),
    S.SERVER_WAITING: (Gauge((_V + "num_requests_waiting",)),),
    S.SERVER_WAITING_DEFERRED: (Gauge((_V + 'num_requests_waiting_by_reason{reason="deferred"}',)),),
    S.SERVER_KV_USAGE: (Gauge((_V + "kv_cache_usage_perc", _V + "gpu_cache_usage_perc"), mean=True),),
    S.SERVER_CPU_KV_USAGE: (Gauge((_V + "cpu_cache_usage_perc",), mean=True),),
    S.SERVER_SWAPPED: (Gauge((_V + "num_requests_swapped",)),),
    S.SERVER_PREEMPTIONS_PER_S: (Rate((_V + "num_preemptions_total",)),),
    S.SERVER_PROMPT_TOKENS_PER_S: (Rate((_V + "prompt_tokens_total",)),),
    S.SERVER_GEN_TOKENS_PER_S: (Rate((_V + "generation_tokens_total",)),),
    # finished_reason (vLLM >= 0.10) tells aborts and errors from successes; older pages count successes only.
    S.SERVER_REQUESTS_PER_S: (Rate((_V + 'request_success_total{finished_reason!~"abort|error"}',
                                    _V + "request_success_total", _V + "e2e_request_latency_seconds_count")),),
    S.SERVER_ABORTS_PER_S: (Rate((_V + 'request_success_total{finished_reason="abort"}',)),),
    S.SERVER_REQUEST_ERRORS_PER_S: (Rate((_V + 'request_success_total{finished_reason="error"}',)),),
    # The API server's HTTP counter (prometheus-fastapi-instrumentator): a request whose client went away is
    # answered there but, when the front end cancels it before the engine finishes it (vLLM 0.32), counted in no
    # finished_reason.
    S.SERVER_HTTP_REQUESTS_PER_S: (Rate(('http_requests_total{handler=~"/v1/.*"}',)),),
    # The same counter's 4xx answers (the instrumentator groups statuses as 2xx/4xx/5xx): requests the server
    # refused before the engine took them (a prompt over --max-model-len is a 400), not clients giving up.
    S.SERVER_HTTP_REJECTED_PER_S: (Rate(('http_requests_total{handler=~"/v1/.*",status=~"4.*"}',)),),
    S.SERVER_PROMPT_TOKENS_CACHED_PER_S: (Rate((_V + "prompt_tokens_cached_total",
                                                _V + 'prompt_tokens_by_source_total{source="local_cache_hit"}')),),
    S.SERVER_ADMISSION_REJECTIONS_PER_S: (Rate((_V + "admission_rejections_total",)),),
    # The engine's own roofline accounting (vLLM >= 0.11): achieved FLOP/s and bytes/s where GPM and DCGM's
    # profiling fields are absent.
    S.SERVER_EST_FLOPS_PER_S: (Rate((_V + "estimated_flops_per_gpu_total",), moving=True),),
    S.SERVER_EST_READ_BYTES_PER_S: (Rate((_V + "estimated_read_bytes_per_gpu_total",), moving=True),),
    S.SERVER_EST_WRITE_BYTES_PER_S: (Rate((_V + "estimated_write_bytes_per_gpu_total",), moving=True),),
    # generated tokens per engine step = sequences decoding together
    S.SERVER_BATCH_SIZE: (StepRatio((_V + "generation_tokens_total",), (_V + "iteration_tokens_total_count",)),),
    S.SERVER_PREFIX_CACHE_HIT_RATE: (
        WindowRatio((((_V + "prefix_cache_hits_total",), (_V + "prefix_cache_queries_total",)),
                     ((_V + "gpu_prefix_cache_hits_total",), (_V + "gpu_prefix_cache_queries_total",)))),
        Gauge((_V + "gpu_prefix_cache_hit_rate",), mean=True, positive=True),  # V0: -1 while disabled
    ),
    S.SERVER_SPEC_ACCEPTANCE_RATE: (
        WindowRatio((((_V + "spec_decode_num_accepted_tokens_total",),
                      (_V + "spec_decode_num_draft_tokens_total",)),)),
        Gauge((_V + "spec_decode_draft_acceptance_rate",), mean=True, positive=True),  # V0
    ),
    S.SERVER_SPEC_MEAN_ACCEPT_LEN: (
        WindowRatio((((_V + "spec_decode_num_accepted_tokens_total",), (_V + "spec_decode_num_drafts_total",)),),
                    plus=1.0),
    ),
    S.SERVER_SPEC_DRAFT_LEN: (
        WindowRatio((((_V + "spec_decode_num_draft_tokens_total",), (_V + "spec_decode_num_drafts_total",)),)),
    ),
    # Drafts proposed per generated token over the window: how often a sequence's step carried a draft at all
    # (ngram speculation proposes one only where the prompt holds a match).
    S.SERVER_SPEC_DRAFTS_PER_TOKEN: (
        WindowRatio((((_V + "spec_decode_num_drafts_total",), (_V + "generation_tokens_total",)),)),
    ),
}
_VLLM_HISTOGRAMS = {
    "ttft": Hist((_V + "time_to_first_token_seconds",)),
    "itl": Hist((_V + "inter_token_latency_seconds", _V + "time_per_output_token_seconds")),
    "tpot": Hist((_V + "request_time_per_output_token_seconds",)),
    "queue_time": Hist((_V + "request_queue_time_seconds",)),
    "prefill_time": Hist((_V + "request_prefill_time_seconds",)),
    "prefill_time_per_token": Hist((_V + "time_per_prefill_token_request_seconds",)),
    "decode_time": Hist((_V + "request_decode_time_seconds",)),
    "inference_time": Hist((_V + "request_inference_time_seconds",)),
    "e2e": Hist((_V + "e2e_request_latency_seconds",)),
    "prompt_len": Hist((_V + "request_prompt_tokens",)),
    "gen_len": Hist((_V + "request_generation_tokens",)),
    "max_tokens": Hist((_V + "request_params_max_tokens",)),
    "max_gen_len": Hist((_V + "request_max_num_generation_tokens",)),
    "params_n": Hist((_V + "request_params_n",)),
    "iteration_tokens": Hist((_V + "iteration_tokens_total",)),
}
VLLM_CACHE_INFO = _V + "cache_config_info"
VLLM_LORA_INFO = _V + "lora_requests_info"


def _vllm(kind: str, label: str, extra_prefixes: tuple[str, ...] = ()) -> ServerMap:
    return ServerMap(kind=kind, label=label, prefixes=(*extra_prefixes, _V), signals=_VLLM_SIGNALS,
                     histograms=_VLLM_HISTOGRAMS, config_names=(VLLM_CACHE_INFO,),
                     absent={S.SERVER_RETRACTIONS_PER_S: "vLLM counts preemptions (server.preemptions_per_s), "
                                                         "not retractions"})


# --- SGLang (sglang: as its metrics collector registers them; sglang_ as some builds and routers write them) --------
#
# Names as SGLang registers them: python/sglang/srt/metrics/collector.py up to 0.5.x, then
# srt/observability/metrics_collector.py (0.5.23: SchedulerMetricsCollector, TokenizerMetricsCollector,
# RadixCacheMetricsCollector); served by prometheus_client in multiprocess mode, so a gauge registered without a
# multiprocess_mode carries a pid label. Families a page may carry that the table does not read are in
# SGLANG_NOT_READ with the reason.

_S = "sglang:"
SGLANG_MAP = ServerMap(
    kind="sglang", label="SGLang", prefixes=(_S, "sglang_"), aliases=(("sglang_", _S),),
    signals={
        S.SERVER_RUNNING: (Gauge((_S + "num_running_reqs",)),),
        S.SERVER_WAITING: (Gauge((_S + "num_queue_reqs",)),),
        S.SERVER_KV_USAGE: (Gauge((_S + "token_usage",), mean=True, percent_above_one=True),),
        # num_used_tokens is the larger of the full-attention and sliding-window pools' used slots; 0.5.23 also
        # exports the full-attention pool's alone (kv_used_tokens), read where the first is missing
        S.SERVER_KV_USED_TOKENS: (Gauge((_S + "num_used_tokens", _S + "kv_used_tokens")),),
        S.SERVER_RETRACTED: (Gauge((_S + "num_retracted_reqs",)),),
        S.SERVER_RETRACTIONS_PER_S: (Rate((_S + "num_retracted_requests_total",)),),
        # A retraction is SGLang's preemption: when a decode step finds no KV space, ScheduleBatch.retract_decode
        # (srt/managers/schedule_batch.py) takes running requests out of the batch, frees their KV slots and puts
        # them back in the waiting queue to be recomputed, as vLLM's scheduler does with a preempted request
        # (num_preemptions_total). The same counter is read as both signals.
        S.SERVER_PREEMPTIONS_PER_S: (Rate((_S + "num_retracted_requests_total",)),),
        S.SERVER_PROMPT_TOKENS_PER_S: (Rate((_S + "prompt_tokens_total",)),),
        # the counter when the page has it; SGLang's own last-interval gauge otherwise
        S.SERVER_GEN_TOKENS_PER_S: (Rate((_S + "generation_tokens_total",)), Gauge((_S + "gen_throughput",))),
        # every request the tokenizer manager finished, aborted ones included (SGLang has no finish-reason label)
        S.SERVER_REQUESTS_PER_S: (Rate((_S + "num_requests_total", _S + "e2e_request_latency_seconds_count")),),
        # TokenizerManager.abort_request: the client disconnected, or an abort was asked for (0.5.23)
        S.SERVER_ABORTS_PER_S: (Rate((_S + "num_aborted_requests_total",)),),
        S.SERVER_PROMPT_TOKENS_CACHED_PER_S: (Rate((_S + "cached_tokens_total",)),),
        # The engine's own roofline accounting, per GPU, as vLLM's (0.5.23's increment_estimated_perf)
        S.SERVER_EST_FLOPS_PER_S: (Rate((_S + "estimated_flops_per_gpu_total",), moving=True),),
        S.SERVER_EST_READ_BYTES_PER_S: (Rate((_S + "estimated_read_bytes_per_gpu_total",), moving=True),),
        S.SERVER_EST_WRITE_BYTES_PER_S: (Rate((_S + "estimated_write_bytes_per_gpu_total",), moving=True),),
        S.SERVER_PREFIX_CACHE_HIT_RATE: (
            WindowRatio((((_S + "cached_tokens_total",), (_S + "prompt_tokens_total",)),
                         ((_S + 'realtime_tokens_total{mode="prefill_cache"}',),
                          (_S + 'realtime_tokens_total{mode="prefill_cache"}',
                           _S + 'realtime_tokens_total{mode="prefill_compute"}')))),
            Gauge((_S + "cache_hit_rate",), mean=True, percent_above_one=True),
        ),
        S.SERVER_SPEC_ACCEPTANCE_RATE: (Gauge((_S + "spec_accept_rate",), mean=True, positive=True),),
        S.SERVER_SPEC_MEAN_ACCEPT_LEN: (Gauge((_S + "spec_accept_length",), mean=True, positive=True),),
        S.SERVER_LORA_RUNNING_ADAPTERS: (Gauge((_S + "lora_pool_slots_used",)),),
        # requests held while the engine takes new weights (an RL trainer's async weight sync), not for KV space
        S.SERVER_PAUSED_WEIGHT_SYNC: (Gauge((_S + "num_paused_reqs",)),),
    },
    histograms={
        "ttft": Hist((_S + "time_to_first_token_seconds",)),
        # inter_token_latency_seconds from 0.4 on (0.5.23 included); time_per_output_token_seconds before it
        "itl": Hist((_S + "inter_token_latency_seconds", _S + "time_per_output_token_seconds")),
        "tpot": Hist((_S + "request_time_per_output_token_seconds",)),
        "queue_time": Hist((_S + "queue_time_seconds",)),
        "e2e": Hist((_S + "e2e_request_latency_seconds",)),
        "prompt_len": Hist((_S + "prompt_tokens_histogram",)),
        "gen_len": Hist((_S + "generation_tokens_histogram",)),
    },
    config_names=(_S + "max_total_num_tokens", _S + "page_size", _S + "context_len", _S + "max_running_requests",
                  _S + "lora_pool_slots_total"),
    absent={S.SERVER_BATCH_SIZE: "SGLang exposes no per-iteration batch metric (server.running is the batch)"},
)

_WHY_POOLS = "the other KV pools of hybrid models (sliding-window attention, Mamba state); token_usage is the fullest"
_WHY_PD = "prefill/decode disaggregation (a separate prefill and decode server); no signal for its transfer queues"
_WHY_DP = "data-parallel attention balance across ranks; no signal for it"
_WHY_CONST = "a constant of the server's start (memory split, start-up times), not a measurement of the window"
_WHY_GRAMMAR = "structured output's grammar compilation and cache; no signal for it"
_WHY_SPEC = "speculative decoding's adaptive tier and block acceptance; read are spec_accept_rate and " \
    "spec_accept_length"
# Every SGLang family (0.5.23) the table does not read, with the reason; a page's family that is neither read nor
# here is new to diagnoser (tests/test_sglang_0523_map.py holds a 0.5.23 page to both).
SGLANG_NOT_READ: dict[str, str] = {
    # KV pool and retraction detail
    _S + "kv_available_tokens": "free slots of the full-attention KV pool: its use is read from token_usage and "
                                "num_used_tokens; diagnoser has no signal for free or evictable slots",
    _S + "kv_evictable_tokens": "radix-cached (evictable) slots of the KV pool: prefix-cache contents that can be "
                                "freed, neither used nor free; no signal means the same",
    _S + "evicted_tokens_total": "cached prefixes evicted from the radix cache to make room (the prefix cache's "
                                 "churn, server.prefix_cache_hit_rate shows its effect), not a running request's "
                                 "KV taken away (retractions, read as preemptions)",
    _S + "eviction_duration_seconds": "time spent evicting radix-cache entries; no signal for it",
    _S + "num_retracted_input_tokens_total": "prompt tokens of retracted requests, to be recomputed: the signal "
                                             "counts requests (server.preemptions_per_s, server.retractions_per_s)",
    _S + "num_retracted_output_tokens_total": "generated tokens of retracted requests, to be recomputed: the signal "
                                              "counts requests",
    _S + "full_token_usage": "the full-attention pool's share, the same as token_usage on a model with no other pool",
    _S + "swa_token_usage": _WHY_POOLS, _S + "mamba_usage": _WHY_POOLS,
    _S + "swa_available_tokens": _WHY_POOLS, _S + "swa_evictable_tokens": _WHY_POOLS,
    _S + "swa_used_tokens": _WHY_POOLS, _S + "mamba_available_tokens": _WHY_POOLS,
    _S + "mamba_evictable_tokens": _WHY_POOLS, _S + "mamba_used_tokens": _WHY_POOLS,
    _S + "decode_sum_seq_lens": "the decode batch's summed sequence lengths; num_used_tokens gives the KV held",
    # tokens and requests
    _S + "prefill_effective_tokens_total": "prefill tokens by cache tier with retraction re-counts left out; the hit "
                                           "rate is read from cached_tokens_total over prompt_tokens_total",
    _S + "uncached_prompt_tokens_histogram": "prompt tokens computed per request: prompt_tokens_histogram and the "
                                             "prefix-cache hit rate give it",
    _S + "spec_verify_calls_total": "speculative verification calls; read are spec_accept_rate and spec_accept_length",
    _S + "num_so_requests_total": "structured-output requests; no signal for them",
    _S + "num_grammar_queue_reqs": _WHY_GRAMMAR, _S + "grammar_compilation_time_seconds": _WHY_GRAMMAR,
    _S + "num_grammar_cache_hit_total": _WHY_GRAMMAR, _S + "num_grammar_aborted_total": _WHY_GRAMMAR,
    _S + "num_grammar_timeout_total": _WHY_GRAMMAR, _S + "num_grammar_total": _WHY_GRAMMAR,
    _S + "grammar_schema_count": _WHY_GRAMMAR, _S + "grammar_ebnf_size": _WHY_GRAMMAR,
    _S + "grammar_tree_traversal_time_avg": _WHY_GRAMMAR, _S + "grammar_tree_traversal_time_max": _WHY_GRAMMAR,
    _S + "per_stage_req_latency_seconds": "per request, time in each scheduler stage; the request's queue time is "
                                          "read from queue_time_seconds",
    _S + "get_loads_duration_seconds": "time to answer a router's load query; no signal for it",
    # the scheduler and the forward pass
    _S + "utilization": "the scheduler's own busy share; the GPU's is read from NVML/DCGM",
    _S + "fwd_occupancy": "the scheduler's forward-pass occupancy; the GPU's busy share is read from NVML/DCGM",
    _S + "new_token_ratio": "the scheduler's estimate of tokens still to generate, a policy parameter",
    _S + "is_cuda_graph": "whether the last batch ran as a CUDA graph; no signal for it (a trace shows graph "
                          "replays)",
    _S + "cuda_graph_passes_total": "forward passes with and without a CUDA graph; no signal for it",
    _S + "forward_execution_seconds_total": "seconds in forward passes by mode; no signal for the engine's own busy "
                                            "time",
    _S + "scheduler_idle_seconds_total": "seconds the scheduler had nothing to run; no signal for it",
    _S + "scheduler_process_cpu_seconds_total": "the scheduler process's CPU seconds; host CPU is read from psutil",
    _S + "scheduler_stage_seconds_total": "scheduler-loop seconds by stage; no signal for it",
    _S + "process_cpu_seconds_total": "CPU seconds of SGLang's helper processes; host CPU is read from psutil",
    _S + "func_latency_seconds": "latency of instrumented functions (--enable-func-timer); no signal for it",
    _S + "num_unique_running_routing_keys": "routing keys (sessions) in the running batch; no signal for them",
    _S + "routing_key_running_req_count": "requests per routing key; no signal for it",
    _S + "routing_key_all_req_count": "requests per routing key; no signal for it",
    _S + "routing_keys_active": "routing keys with requests in flight; no signal for them",
    _S + "http_requests_total": "the HTTP layer's requests by endpoint, all endpoints together (/metrics and /health "
                                "included); server.requests_per_s is the engine's",
    _S + "http_responses_total": "the HTTP layer's answers by endpoint and status, all endpoints together",
    _S + "http_requests_active": "HTTP requests in flight; server.running and server.waiting are the engine's",
    # speculative decoding beyond acceptance
    _S + "spec_cap_length": _WHY_SPEC, _S + "spec_block_accept_length": _WHY_SPEC,
    _S + "spec_num_steps": _WHY_SPEC, _S + "spec_num_draft_tokens": _WHY_SPEC,
    # constants
    _S + "num_pages": _WHY_CONST, _S + "max_total_num_tokens_swa": _WHY_CONST,
    _S + "weight_memory_usage_gb": _WHY_CONST, _S + "kv_cache_memory_usage_gb": _WHY_CONST,
    _S + "graph_memory_usage_gb": _WHY_CONST, _S + "startup_available_gpu_memory_gb": _WHY_CONST,
    _S + "startup_time_seconds": _WHY_CONST, _S + "startup_cuda_graph_time_seconds": _WHY_CONST,
    _S + "startup_latency_breakdown_seconds_max": _WHY_CONST, _S + "weight_load_duration_seconds": _WHY_CONST,
    _S + "max_running_requests_under_SLO": _WHY_CONST,
    # prefill/decode disaggregation
    **{_S + n: _WHY_PD for n in (
        "num_prefill_bootstrap_queue_reqs", "num_prefill_inflight_queue_reqs", "num_decode_prealloc_queue_reqs",
        "num_decode_transfer_queue_reqs", "num_decode_host_receive_queue_reqs", "num_decode_host_receive_reqs_total",
        "num_decode_deferred_kv_release_reqs", "decode_deferred_kv_release_seconds", "decode_deferred_kv_release_total",
        "kv_transfer_speed_gb_s", "kv_transfer_latency_ms", "pending_prealloc_token_usage",
        "prealloc_full_token_usage", "prealloc_swa_token_usage", "num_bootstrap_failed_reqs_total",
        "num_transfer_failed_reqs_total", "num_prefill_retries_total", "kv_transfer_bootstrap_ms",
        "kv_transfer_alloc_ms", "kv_transfer_total_mb")},
    # data-parallel attention
    **{_S + n: _WHY_DP for n in (
        "dp_cooperation_realtime_tokens_total", "dp_cooperation_forward_execution_seconds_total",
        "dp_attention_tokens_total", "dp_attention_steps_total", "dp_attention_pairs_total",
        "dp_attention_token_imbalance_ratio", "dp_attention_sync_wait_seconds", "eplb_balancedness")},
    _S + "prefill_delayer_wait_forward_passes": "the prefill delayer's waits (data-parallel attention); no signal",
    _S + "prefill_delayer_wait_seconds": "the prefill delayer's waits (data-parallel attention); no signal",
    _S + "prefill_delayer_outcomes_total": "the prefill delayer's outcomes (data-parallel attention); no signal",
    # features off by default
    _S + "lora_pool_utilization": "lora_pool_slots_used is read (and lora_pool_slots_total kept with the "
                                  "configuration)",
    **{_S + n: "the hierarchical (host and storage) KV cache, off by default; no signal for its tiers" for n in (
        "hicache_host_used_tokens", "hicache_host_total_tokens", "hicache_host_mamba_used_states",
        "hicache_host_mamba_total_states", "load_back_duration_seconds", "load_back_tokens_total",
        "hicache_backup_duration_seconds", "hicache_backup_bytes_total", "load_back_bytes_total",
        "hicache_backup_tokens_total", "hicache_dropped_tokens_total")},
    **{_S + n: "the hierarchical cache's storage tier (StorageMetricsCollector), off by default; no signal for it"
       for n in ("prefetched_tokens_total", "backuped_tokens_total", "prefetch_pgs", "backup_pgs",
                 "prefetch_bandwidth", "backup_bandwidth", "storage_prefetch_hit_tokens_total",
                 "storage_prefetch_unfulfilled_tokens_total", "storage_prefetch_deferred_tokens_total",
                 "hicache_backup_dropped_tokens_total", "hicache_prefetch_aux_alloc_failed_tokens_total")},
    _S + "eplb_gpu_physical_count": "expert-parallel load balancing's expert placement; no signal for it",
    _S + "failed_session_recoveries_total": "the Mooncake KV transfer's session recoveries (disaggregation); no "
                                            "signal for them",
    **{_S + n: "the multimodal encoder server (encoder disaggregation, EncoderMetricsCollector); no signal for it"
       for n in ("encoder_requests_received_total", "encoder_requests_total", "encoder_request_e2e_latency_seconds",
                 "encoder_queue_wait_seconds", "encoder_preprocess_seconds", "encoder_model_forward_seconds",
                 "encoder_transfer_seconds", "encoder_mm_items_per_request", "encoder_mm_items_per_batch",
                 "encoder_dp_pending_requests", "encoder_cache_entries", "encoder_cache_size_mb",
                 "encoder_cache_hit_files_total", "encoder_cache_total_files_total", "encoder_cache_hit_tokens_total",
                 "encoder_cache_total_tokens_total", "encoder_cache_evictions_total")},
    _S + "num_streaming_sessions": "streaming sessions (--enable-streaming-session); no signal for them",
    _S + "streaming_session_held_tokens": "KV tokens streaming sessions hold between turns; no signal for them",
}

# --- HuggingFace TGI (router metrics; histograms are summaries in older releases) ---------------------------------

TGI_MAP = ServerMap(
    kind="tgi", label="TGI", prefixes=("tgi_",),
    signals={
        S.SERVER_RUNNING: (Gauge(("tgi_batch_current_size",)),),
        S.SERVER_WAITING: (Gauge(("tgi_queue_size",)),),
        S.SERVER_BATCH_SIZE: (Gauge(("tgi_batch_current_size",)),),
        S.SERVER_BATCH_RESERVED_TOKENS: (Gauge(("tgi_batch_current_max_tokens",)),),
        S.SERVER_PROMPT_TOKENS_PER_S: (Rate(("tgi_request_input_length_sum",)),),
        S.SERVER_GEN_TOKENS_PER_S: (Rate(("tgi_request_generated_tokens_sum",)),),
        S.SERVER_REQUESTS_PER_S: (Rate(("tgi_request_success", "tgi_request_success_total")),),
    },
    histograms={
        "itl": Hist(("tgi_request_mean_time_per_token_duration",)),
        "queue_time": Hist(("tgi_request_queue_duration",)),
        "inference_time": Hist(("tgi_request_inference_duration",)),
        "e2e": Hist(("tgi_request_duration",)),
        # the forward pass (TGI >= 1.3.3); before it only the whole step, forward plus detokenising and filtering
        "prefill_step": Hist(('tgi_batch_forward_duration{method="prefill"}',
                              'tgi_batch_inference_duration{method="prefill"}')),
        "decode_step": Hist(('tgi_batch_forward_duration{method="decode"}',
                             'tgi_batch_inference_duration{method="decode"}')),
        "prompt_len": Hist(("tgi_request_input_length",)),
        "gen_len": Hist(("tgi_request_generated_tokens",)),
        "max_tokens": Hist(("tgi_request_max_new_tokens",)),
    },
    absent={S.SERVER_KV_USAGE: "TGI exposes no KV-cache usage metric",
            S.SERVER_PREEMPTIONS_PER_S: "TGI exposes no preemption counter",
            S.SERVER_TTFT_P50_S: "TGI exposes no time-to-first-token metric",
            S.SERVER_TTFT_P99_S: "TGI exposes no time-to-first-token metric"},
)

# --- Triton, with the TensorRT-LLM backend's nv_trt_llm_* families when it is loaded -------------------------------

_T = "nv_trt_llm_"
# The backend's families were *_statistics up to tensorrtllm_backend 0.6.x (Triton 23.11-23.12) and *_metrics from
# 0.7.0 on, with the same labels (0.7 and later add label values: waiting requests, the KV fraction, paused
# requests). Old spelling -> the one the table reads.
TRTLLM_OLD_NAMES = tuple((_T + f + "_statistics", _T + f + "_metrics")
                         for f in ("request", "runtime_memory", "kv_cache_block", "inflight_batcher", "v1", "general"))
TRITON_MAP = ServerMap(
    kind="triton", label="Triton", prefixes=(_T, "nv_llm_", "nv_inference_"), aliases=TRTLLM_OLD_NAMES,
    signals={
        S.SERVER_RUNNING: (Gauge((_T + 'request_metrics{request_type="active"}',)),),
        S.SERVER_WAITING: (Gauge((_T + 'request_metrics{request_type="waiting"}',
                                  "nv_inference_pending_request_count")),),
        S.SERVER_PREFILL_REQUESTS: (Gauge((_T + 'request_metrics{request_type="context"}',)),),
        S.SERVER_PAUSED: (Gauge((_T + 'inflight_batcher_metrics{inflight_batcher_specific_metric="paused_requests"}',
                                 )),),
        S.SERVER_KV_USAGE: (Gauge((_T + 'kv_cache_block_metrics{kv_cache_block_type="fraction"}',), mean=True),
                            GaugeRatio(_T + 'kv_cache_block_metrics{kv_cache_block_type="used"}',
                                       _T + 'kv_cache_block_metrics{kv_cache_block_type="max"}')),
        S.SERVER_REQUESTS_PER_S: (Rate(("nv_inference_request_success", "nv_inference_request_success_total")),),
        S.SERVER_PROMPT_TOKENS_PER_S: (Rate(("nv_llm_input_token_len_sum",)),),
        S.SERVER_GEN_TOKENS_PER_S: (Rate(("nv_llm_output_token_len_sum",)),),
        # TensorRT-LLM's scheduled requests per iteration; plain Triton documents inference count / execution count
        S.SERVER_BATCH_SIZE: (Gauge((_T + 'request_metrics{request_type="scheduled"}',)),
                              StepRatio(("nv_inference_count", "nv_inference_count_total"),
                                        ("nv_inference_exec_count", "nv_inference_exec_count_total"))),
        S.SERVER_QUEUE_TIME_MEAN_S: (
            WindowRatio(((("nv_inference_queue_duration_us",), ("nv_inference_request_success",)),
                         (("nv_inference_queue_duration_us_total",), ("nv_inference_request_success_total",))),
                        scale=1e-6),
        ),
    },
    histograms={
        "ttft": Hist(("nv_inference_first_response_histogram_ms",), scale=1e-3),
        "prompt_len": Hist(("nv_llm_input_token_len",)),
        "gen_len": Hist(("nv_llm_output_token_len",)),
    },
    config_names=(_T + "kv_cache_block_metrics", _T + "request_metrics"),
    absent=_absent({S.SERVER_PREEMPTIONS_PER_S: "TensorRT-LLM pauses requests when KV blocks run out (server.paused), "
                                                "it has no preemption counter",
                    S.SERVER_ITL_P50_S: "Triton exposes no inter-token latency metric",
                    S.SERVER_ITL_P99_S: "Triton exposes no inter-token latency metric"}),
    absent_without_backend=_absent(dict.fromkeys(
        (S.SERVER_RUNNING, S.SERVER_KV_USAGE, S.SERVER_PROMPT_TOKENS_PER_S, S.SERVER_GEN_TOKENS_PER_S),
        "Triton reports requests and executions; tokens, KV cache and token latencies only with the TensorRT-LLM "
        "backend's nv_trt_llm_* metrics, which this page lacks")),
    backend_prefixes=(_T,),
)

# --- NVIDIA NIM for LLMs (documented table; names without a prefix, served at /v1/metrics) -------------------------

NIM_MAP = ServerMap(
    kind="nim", label="NVIDIA NIM", prefixes=("num_request_max",),
    signals={
        S.SERVER_RUNNING: (Gauge(("num_requests_running",)),),
        S.SERVER_WAITING: (Gauge(("num_requests_waiting",)),),
        S.SERVER_KV_USAGE: (Gauge(("gpu_cache_usage_perc",), mean=True),),
        S.SERVER_PROMPT_TOKENS_PER_S: (Rate(("prompt_tokens_total",)),),
        S.SERVER_GEN_TOKENS_PER_S: (Rate(("generation_tokens_total",)),),
        S.SERVER_REQUESTS_PER_S: (Rate(("request_success_total", "e2e_request_latency_seconds_count")),),
    },
    histograms={
        "ttft": Hist(("time_to_first_token_seconds",)),
        "itl": Hist(("time_per_output_token_seconds",)),
        "e2e": Hist(("e2e_request_latency_seconds",)),
        "prompt_len": Hist(("request_prompt_tokens",)),
        "gen_len": Hist(("request_generation_tokens",)),
    },
    config_names=("num_request_max",),
    absent={S.SERVER_PREEMPTIONS_PER_S: "NIM's documented metrics have no preemption counter",
            S.SERVER_BATCH_SIZE: "NIM's documented metrics have no per-iteration batch metric (server.running is the "
                                 "batch)"},
)

# --- llama.cpp's server (llama-server --metrics; tools/server/server-task.cpp to_metrics in build 11434) -----------
#
# The page is a handful of counters and gauges, no histograms: latencies and the batch are derived from counters over
# the window. Generated tokens and their seconds are added when a request finishes (metrics_on_prediction), prompt
# tokens and their seconds as each prompt batch is synchronised, so the per-scrape rates are lumpy and the window's
# ratios are what is read. Build 11434 has no KV-cache use on the page; older builds export
# llamacpp:kv_cache_usage_ratio and llamacpp:kv_cache_tokens, read where present (11434's own
# tools/server/bench/bench.py still queries the first; its tests/unit/test_metrics.py lists the families read here).
# prompt_tokens_cached_total is read where the build exports it. Not mapped: prompt_tokens_seconds and
# predicted_tokens_seconds (throughput while busy, averaged between two scrapes: the counters give the same over the
# window), n_tokens_max (the longest sequence since start, kept with the configuration) and
# spec_decode_num_accepted_tokens_per_pos_total (per draft position).

_L = "llamacpp:"
# llamacpp:n_busy_slots_per_decode is busy slots over decode calls since start; times n_decode_total it is the busy
# slots' count, made by server_metrics.canonical under this name, whose increase over the window's decode calls is the
# window's batch.
LLAMACPP_BUSY_SLOTS = _L + "n_busy_slots_total"
LLAMACPP_MAP = ServerMap(
    kind="llamacpp", label="llama.cpp", prefixes=(_L,),
    signals={
        S.SERVER_RUNNING: (Gauge((_L + "requests_processing",)),),
        S.SERVER_WAITING: (Gauge((_L + "requests_deferred",)),),
        S.SERVER_KV_USAGE: (Gauge((_L + "kv_cache_usage_ratio",), mean=True),),  # older builds only
        S.SERVER_KV_USED_TOKENS: (Gauge((_L + "kv_cache_tokens",)),),  # older builds only
        S.SERVER_PROMPT_TOKENS_PER_S: (Rate((_L + "prompt_tokens_total",)),),  # processed, cached ones excluded
        S.SERVER_GEN_TOKENS_PER_S: (Rate((_L + "tokens_predicted_total",)),),
        S.SERVER_PROMPT_TOKENS_CACHED_PER_S: (Rate((_L + "prompt_tokens_cached_total",)),),
        # busy slots per llama_decode() call over the interval; the page's own gauge (since start) where the decode
        # counter is missing
        S.SERVER_BATCH_SIZE: (StepRatio((LLAMACPP_BUSY_SLOTS,), (_L + "n_decode_total",)),
                              Gauge((_L + "n_busy_slots_per_decode",), mean=True)),
        # tokens per llama_decode() call over the window: each call holds at most --batch-size tokens (update_slots
        # fills one batch, a decoding slot's token first, then prompt chunks, and decodes it in --batch-size pieces;
        # tools/server/server-context.cpp), so a mean near it says the logical batch caps the step. Generated tokens
        # are counted as requests finish: over a window of many requests the ratio holds, per interval it would not.
        S.SERVER_ITERATION_TOKENS_MEAN: (
            WindowRatio((((_L + "prompt_tokens_total", _L + "tokens_predicted_total"), (_L + "n_decode_total",)),)),
        ),
        S.SERVER_PREFIX_CACHE_HIT_RATE: (
            WindowRatio((((_L + "prompt_tokens_cached_total",),
                          (_L + "prompt_tokens_cached_total", _L + "prompt_tokens_total")),)),
        ),
        # per request, generating seconds over generated tokens (summed over the requests that finished)
        S.SERVER_TPOT_MEAN_S: (WindowRatio((((_L + "tokens_predicted_seconds_total",),
                                             (_L + "tokens_predicted_total",)),)),),
        # prompt batches' seconds over the prompt tokens they processed
        S.SERVER_PREFILL_TIME_PER_TOKEN_MEAN_S: (WindowRatio((((_L + "prompt_seconds_total",),
                                                               (_L + "prompt_tokens_total",)),)),),
        S.SERVER_SPEC_ACCEPTANCE_RATE: (
            WindowRatio((((_L + "spec_decode_num_accepted_tokens_total",),
                          (_L + "spec_decode_num_draft_tokens_total",)),)),
        ),
        S.SERVER_SPEC_MEAN_ACCEPT_LEN: (
            WindowRatio((((_L + "spec_decode_num_accepted_tokens_total",), (_L + "spec_decode_num_drafts_total",)),),
                        plus=1.0),
        ),
        S.SERVER_SPEC_DRAFT_LEN: (
            WindowRatio((((_L + "spec_decode_num_draft_tokens_total",), (_L + "spec_decode_num_drafts_total",)),)),
        ),
        S.SERVER_SPEC_DRAFTS_PER_TOKEN: (
            WindowRatio((((_L + "spec_decode_num_drafts_total",), (_L + "tokens_predicted_total",)),)),
        ),
    },
    config_names=(_L + "n_tokens_max",),
    absent=_absent({
        S.SERVER_KV_USAGE: "llama.cpp's /metrics has no KV-cache use (build 11434; older builds' "
                           "llamacpp:kv_cache_usage_ratio is not on this page)",
        S.SERVER_PREEMPTIONS_PER_S: "llama.cpp runs each request in its own slot and never preempts one",
        S.SERVER_REQUESTS_PER_S: "llama.cpp's /metrics counts tokens, not requests",
        S.SERVER_TTFT_P50_S: "llama.cpp's /metrics has no latency histograms (server.tpot_mean_s and "
                             "server.prefill_time_per_token_mean_s are derived from its counters)",
        S.SERVER_TTFT_P99_S: "llama.cpp's /metrics has no latency histograms",
        S.SERVER_ITL_P50_S: "llama.cpp's /metrics has no latency histograms (server.tpot_mean_s is the window's mean "
                            "time per generated token, from its counters)",
        S.SERVER_ITL_P99_S: "llama.cpp's /metrics has no latency histograms",
    }),
)

SERVER_MAPS: dict[str, ServerMap] = {
    "vllm": _vllm("vllm", "vLLM"),
    "demo": _vllm("demo", "diagnoser demo", ("diagnoser_demo_info",)),
    "sglang": SGLANG_MAP,
    "tgi": TGI_MAP,
    "triton": TRITON_MAP,
    "nim": NIM_MAP,
    "llamacpp": LLAMACPP_MAP,
}

# Signals every map is checked for at the end of a window (absent ones are said, never zeroed).
CORE_SIGNALS = (S.SERVER_RUNNING, S.SERVER_WAITING, S.SERVER_KV_USAGE, S.SERVER_PREEMPTIONS_PER_S,
                S.SERVER_PROMPT_TOKENS_PER_S, S.SERVER_GEN_TOKENS_PER_S, S.SERVER_REQUESTS_PER_S,
                S.SERVER_TTFT_P50_S, S.SERVER_TTFT_P99_S, S.SERVER_ITL_P50_S, S.SERVER_ITL_P99_S,
                S.SERVER_BATCH_SIZE)


def detect_kind(names: Iterable[str]) -> str | None:
    """The engine whose names the page carries most of: vLLM, SGLang, TGI, Triton, llama.cpp, NIM or the demo (its
    info gauge). A page from the demo also carries vllm: names, so the demo's marker decides first."""
    names = list(names)
    if any(n.startswith("diagnoser_demo_info") for n in names):
        return "demo"
    counts: dict[str, int] = {}
    for kind in ("vllm", "sglang", "tgi", "triton", "llamacpp"):
        prefixes = SERVER_MAPS[kind].prefixes
        counts[kind] = sum(1 for n in names if n.startswith(prefixes))
    # NIM writes vLLM's old names without a prefix; its num_request_max gauge is its own
    if not any(counts.values()) and ("num_request_max" in names or
                                     ("num_requests_running" in names and "gpu_cache_usage_perc" in names)):
        return "nim"
    best = max(counts, key=lambda k: counts[k])
    return best if counts[best] else None
