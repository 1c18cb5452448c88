"""llama.cpp's server (llama-server) scheduler knobs, as read from build 11434's own source: common/common.h (the
defaults of common_params), common/arg.cpp (the flags and their environment variables) and tools/server/server.cpp
(what the server does with them: `-np -1`, the default, becomes 4 slots sharing one unified KV buffer).

The server runs a fixed number of slots (`--parallel`), each one request at a time. Each step it packs one logical
batch of up to `--batch-size` tokens (one per decoding slot, a prompt chunk per prefilling one), computed in physical
micro-batches of `--ubatch-size`; a request waits ("deferred") while every slot is busy. The KV cache holds
`--ctx-size` tokens: split evenly over the slots, or shared by all of them with a unified buffer (`--kv-unified`),
where each slot may grow to the whole context. A prompt longer than its slot's context is refused. Knobs whose
meaning is the same as vLLM's carry vLLM's names (the ServingConfig keys), so the rules read both tables alike:
slots are max_num_seqs, the context a slot may hold is max_model_len, the logical batch is max_num_batched_tokens.

Versions are build numbers ("b11434", the /props page's build_info); the defaults below are those of build 11434
and are not extended to older builds, whose defaults differ (before the automatic slot count, one slot).
"""

from __future__ import annotations

from diagnoser.diagnosis import FixKind
from diagnoser.engines.knobs import Default, Direction, Knob

B11434 = (11434,)  # the build whose source the defaults are read from
_SRC = "llama.cpp b11434"

PARALLEL = Knob(
    "max_num_seqs", "server slots", ("--parallel", "-np"), env=("LLAMA_ARG_N_PARALLEL",),
    constrains="requests decoding together (one per slot); a request finding every slot busy is deferred",
    binds="every slot busy (requests processing at the slot count) while requests are deferred",
    relieves=Direction.RAISE,
    trades="without a unified KV buffer, each slot's context is --ctx-size / slots: more slots, shorter "
    "requests; with one, slots share the buffer and a long request can crowd the others out",
    bounds="the decode physics at the larger batch where the model and device are known; the context each slot "
    "keeps otherwise",
    fixes={Direction.RAISE: FixKind.BATCH_MORE},
    defaults=(Default(B11434, 4, f"{_SRC} default (tools/server/server.cpp: -np -1, auto, is 4 slots with a "
                                 "unified KV buffer)"),),
)
CTX_PER_SLOT = Knob(
    "max_model_len", "context per slot", ("--ctx-size", "-c"), env=("LLAMA_ARG_CTX_SIZE",),
    constrains="prompt + output tokens of one request: --ctx-size / slots per slot, or the whole --ctx-size with a "
    "unified KV buffer; a longer prompt is refused",
    binds="4xx answers for prompts over a slot's context",
    relieves=Direction.RAISE, trades="KV memory (the whole --ctx-size is allocated at start)",
    bounds="the model's trained context (n_ctx_train) and the device's memory",
    fixes={Direction.RAISE: FixKind.CONTEXT_LENGTH},
    # -c 0 (the default) loads the model's trained context, possibly cut to fit memory: no fixed default
)
BATCH_SIZE = Knob(
    "max_num_batched_tokens", "logical batch", ("--batch-size", "-b"), env=("LLAMA_ARG_BATCH",),
    constrains="tokens in one llama_decode step: one per decoding slot, a prompt chunk per prefilling one",
    binds="prompts longer than the batch (each prefilled over several decode calls) while the busy slots spend "
    "much of their time in prompt processing (a request is deferred only when every slot is busy, so deferrals "
    "alone do not tell this knob from --parallel)",
    relieves=Direction.RAISE,
    trades="raised: fewer, longer prefill steps (decoding slots that share a step wait longer); lowered: shorter "
    "steps and a longer time to first token",
    bounds="prompt tokens per step: a prompt needs ceil(prompt / batch) steps, and no step runs faster than its "
    "compute",
    fixes={Direction.RAISE: FixKind.TOKEN_BUDGET, Direction.LOWER: FixKind.CAP_PREFILL},
    defaults=(Default(B11434, 2048, f"{_SRC} default (common/common.h n_batch)"),),
)
UBATCH_SIZE = Knob(
    "ubatch_size", "physical batch", ("--ubatch-size", "-ub"), env=("LLAMA_ARG_UBATCH",),
    constrains="tokens computed in one pass of the device (a logical batch runs as ceil(batch / ubatch) passes)",
    binds="prompt processing well below the device's compute roof with long prompts (small passes)",
    relieves=Direction.RAISE, trades="compute-buffer memory, which grows with it",
    bounds="the device's compute roof for prompt processing; decode steps of a few slots fit one pass anyway",
    fixes={Direction.RAISE: FixKind.TOKEN_BUDGET},
    defaults=(Default(B11434, 512, f"{_SRC} default (common/common.h n_ubatch)"),),
)
CONT_BATCHING = Knob(
    "continuous_batching", "continuous batching", ("--cont-batching", "-cb"), env=("LLAMA_ARG_CONT_BATCHING",),
    constrains="whether a new request joins the running slots' steps or waits for the batch to drain",
    binds="slots idle while requests are deferred (continuous batching off)",
    relieves=Direction.ON, trades="nothing measurable", bounds="the slots the drain leaves idle",
    fixes={Direction.ON: FixKind.CONTINUOUS_BATCHING},
    defaults=(Default(B11434, True, f"{_SRC} default (common/common.h cont_batching)"),), kind=bool,
)
KV_UNIFIED = Knob(
    "kv_unified", "unified KV buffer", ("--kv-unified", "-kvu"), env=("LLAMA_ARG_KV_UNIFIED",),
    constrains="whether the slots share one KV buffer of --ctx-size tokens or each hold --ctx-size / slots",
    binds="requests refused for their length while other slots hold little (split buffer)",
    relieves=None, trades="shared: one long request can take the room others need",
    bounds="the context a slot may hold; it adds no memory",
    fixes={},
    # server.cpp turns it on with the automatic slot count (-np unset); off otherwise
    defaults=(Default(B11434, True, f"{_SRC} default with -np unset (tools/server/server.cpp); off with -np N"),),
    kind=bool,
)
CACHE_PROMPT = Knob(
    "prefix_caching", "prompt cache", ("--cache-prompt",), env=("LLAMA_ARG_CACHE_PROMPT",),
    constrains="whether a slot reuses the KV of the common prefix its previous prompt left instead of prefilling "
    "it again",
    binds="prompts that share prefixes recomputed (cached prompt tokens near zero) with it off",
    relieves=Direction.ON, trades="nothing measurable when prompts share nothing",
    bounds="the prompt tokens the hits would save", fixes={Direction.ON: FixKind.PREFIX_CACHING},
    defaults=(Default(B11434, True, f"{_SRC} default (common/common.h cache_prompt)"),), kind=bool,
)
CACHE_REUSE = Knob(
    "cache_reuse", "cache reuse by KV shifting", ("--cache-reuse",), env=("LLAMA_ARG_CACHE_REUSE",),
    constrains="the shortest chunk of a cached prompt reused after a change earlier in the prompt (0: only the "
    "common prefix is reused)",
    binds="prompts that share chunks after differing beginnings recomputed",
    relieves=Direction.RAISE, trades="chunks reused out of place (KV shifted): close, not identical, attention",
    bounds="the prompt tokens the reused chunks would save", fixes={Direction.RAISE: FixKind.PREFIX_CACHING},
    defaults=(Default(B11434, 0, f"{_SRC} default (common/common.h n_cache_reuse: off)"),),
)
CACHE_RAM = Knob(
    "cache_ram_mib", "host prompt cache", ("--cache-ram", "-cram"), env=("LLAMA_ARG_CACHE_RAM",),
    constrains="MiB of host memory keeping idle slots' prompts for later reuse (-1: no limit, 0: off)",
    binds="returning prompts prefilled again after their slot was reused",
    relieves=Direction.RAISE, trades="host memory", bounds="the prompt tokens the hits would save",
    fixes={Direction.RAISE: FixKind.PREFIX_CACHING},
    defaults=(Default(B11434, 8192, f"{_SRC} default (common/common.h cache_ram_mib)"),),
)
DRAFT_MODEL = Knob(
    "speculative_config", "draft model", ("--model-draft", "-md", "--spec-draft-model"),
    env=("LLAMA_ARG_SPEC_DRAFT_MODEL",),
    constrains="draft tokens proposed by a small model and verified per step (in b11434 a plain draft model "
    "drafts only with --spec-type draft-simple: the type is otherwise read from the draft's GGUF, and -md alone "
    "loads it and drafts nothing)",
    binds="drafts rarely accepted while the draft model costs every step",
    relieves=Direction.OFF, trades="decode speed at high acceptance", bounds="the step time the draft costs",
    fixes={Direction.OFF: FixKind.SPEC_DECODE, Direction.ON: FixKind.SPEC_DECODE}, kind=str,
)
DRAFT_MAX = Knob(
    "draft_max", "draft length", ("--spec-draft-n-max", "--draft-max", "--draft"),
    env=("LLAMA_ARG_SPEC_DRAFT_N_MAX",),
    constrains="draft tokens proposed per step at most (--draft-max is the older spelling, removed in b11434)",
    binds="long drafts mostly rejected (acceptance low, draft length high)",
    relieves=Direction.LOWER, trades="fewer tokens per step at high acceptance",
    bounds="the accepted tokens per step", fixes={Direction.LOWER: FixKind.SPEC_DECODE},
    defaults=(Default(B11434, 3, f"{_SRC} default (common/common.h speculative draft n_max)"),),
)

KNOBS: tuple[Knob, ...] = (
    PARALLEL, CTX_PER_SLOT, BATCH_SIZE, UBATCH_SIZE, CONT_BATCHING, KV_UNIFIED, CACHE_PROMPT, CACHE_REUSE, CACHE_RAM,
    DRAFT_MODEL, DRAFT_MAX,
)
BY_NAME = {k.name: k for k in KNOBS}
