"""Engine config (torch-free). argparse / YAML / TOML parsing lives at the edge (server)."""

from __future__ import annotations

import dataclasses
import math

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "te")
DEVICES = ("auto", "cpu", "cuda")
LM_HEAD_DTYPES = ("model", "float32")
ROUTER_DTYPES = ("auto", "model", "fp32", "fp64")
METRICS_REDUCTIONS = ("step", "microbatch")
WEIGHT_SET_POLICIES = ("resident", "host")
DEFAULT_WEIGHT_SET = "default"
"""The name of the one weight set of a replica started with ``model`` alone."""
MASTER_PORT_FILE_ENV = "MEGASCORE_MASTER_PORT_FILE"
"""Set instead of MASTER_PORT by a launcher: rank 0's store binds a free port and writes
it to this file, the other ranks read it there (``megascore.engine.ranks.rendezvous``)."""


@dataclasses.dataclass
class EngineConfig:
    """How one model replica is built and run. Identical on every rank."""

    model: str = "tiny"
    """Built-in model name (tiny, tiny-moe, tiny-deep, bench, bench-8b; ``NAME@SEED`` picks
    the weight seed), ``hf:DIR`` or ``megatron:DIR``. With ``weights``, the first set's."""
    weights: tuple[str, ...] = ()
    """Named full weight sets of one architecture, each ``NAME=MODEL`` (repeat the flag);
    the first is the default set, a request names another by its ``model`` option. Unset:
    one set named ``default``, ``model``'s (docs/engine.md "Weight sets")."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters loaded at start-up, each ``NAME=DIR[@SET]`` (repeat ``--adapter``): the
    peft directory ``DIR`` (``adapter_config.json`` + ``adapter_model.safetensors``) over
    weight set ``SET`` (default: the default set); a request's ``model`` names it
    (docs/engine.md "LoRA adapters")."""
    weight_sets: str = "resident"
    """Where the sets that are not live wait: "resident" (on the device; switching a step's
    set points the parameters at its tensors, no copy) or "host" (host memory, pinned for
    CUDA; a switch copies the set in at the step boundary)."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: ranks each weight matrix is split over."""
    context_parallel_size: int = 1
    """Context-parallel size: ranks each sequence is split over (in 2 x CP chunks)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size of a MoE model: ranks the experts are spread over (divides the
    data-parallel x context-parallel ranks)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages: each holds a contiguous run of decoder layers (any split; the
    first and last stage take the remainder when layers do not divide evenly)."""
    pipeline_microbatches: int | None = None
    """Microbatches per step under pipeline parallelism (contiguous runs of sequences,
    balanced by padded tokens; fewer when a step has fewer sequences). Unset: 1 at PP = 1,
    2 x PP otherwise. MoE / MTP metrics do not depend on it (``metrics_reduction``)."""
    metrics_reduction: str = "step"
    """How a step's MoE / MTP metrics are defined: "step" (Megatron's formulas on the
    statistics of the whole step: the same for any layout and microbatch count) or
    "microbatch" (Megatron's own value, the mean over the step's microbatches, as a
    trainer logs it). docs/engine.md, MoE and MTP metrics."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism (TP > 1 only); unset: on for a MoE model with TP > 1.

    None (``none`` / ``null`` in a config file or the environment) lets the engine
    decide (:meth:`sequence_parallel_for`); True / False is an explicit override."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (cuda when available)."""
    dtype: str = "float32"
    """Parameter and activation dtype of the model."""
    attention_backend: str = "auto"
    """"te" (TransformerEngine, GPU; bfloat16 / float16), "torch" (portable SDPA) or "auto".

    "auto" is "te" where TransformerEngine imports, the device is CUDA and the dtype is
    bfloat16 / float16, else "torch" (TE's fused attention has no float32 THD path)."""
    lm_head_dtype: str = "model"
    """dtype of the output layer's matmul: "model" (as the Megatron trainer: logits in the
    model dtype, upcast to float32 for the log-softmax) or "float32" (float32 logits)."""
    moe_router_dtype: str = "auto"
    """dtype of a MoE router's gating and scores: "auto" (as the model family's trainer:
    fp32 for DeepSeek-V3 and GLM-4.5, the model dtype otherwise), "model" (the model
    dtype), "fp32" or "fp64" (Megatron's ``moe_router_dtype``)."""
    pad_to_multiple_of: int = 1
    """Extra per-sequence pad multiple (combined with what CP / SP require)."""
    max_top_k: int = 256
    """Largest ``top_k`` a request may ask for (distillation asks for wide top-k)."""
    max_target_ids: int = 256
    """Largest number of caller-chosen target ids per token (``ScoreRequest.target_ids``)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the vocab-parallel log-softmax (bounds peak memory)."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective; a hung rank fails the step instead of hanging."""
    load_timeout_s: float = 1800.0
    """How long the ranks wait for one another around a model load (the rendezvous, the
    agreements once a start-up load or ``LoadWeights`` is read and written), whatever
    ``collective_timeout_s`` is: ranks finish reading a large checkpoint minutes apart. A
    rank that dies meanwhile is seen at once (its connections close); a hung one after this."""
    seed: int | None = None
    """Overrides the model config's seed for built-in random weights."""
    ignore_mtp_layers: bool = False
    """Serve without the model's MTP layers even where the checkpoint holds them (``hf:``
    checkpoints and built-ins); MTP layers the files do not hold are always left out."""
    batch_invariant: bool | None = None
    """Bit-identical results for a sequence whatever else is in the step (every token-axis
    matmul padded to at least 64 rows, the MLP activation run on a padded copy). Unset: on
    for the CPU, off on CUDA; True on CUDA is refused at start-up (no batch-invariant
    kernels there yet, docs/deploy.md).

    Implemented in ``megascore.model.batch_invariant``."""
    prefix_sharing: bool | None = None
    """Compute a prefix that sequences of a step share once (GRPO groups); unset: on for CPU.

    None (auto) is on for the CPU and off on GPU (not measured there yet: docs/deploy.md);
    True is on, on GPU too (the ``torch`` attention backend); False is the dense forward.
    The TE backend runs dense."""
    min_shared_prefix: int = 16
    """Shortest shared prefix (in tokens) computed once when ``prefix_sharing`` is on."""
    prefix_cache: bool | None = None
    """Keep the keys and values of scored prefixes between calls (docs/engine.md "Prefix
    cache"). Unset: on where it runs by default (the CPU, batch-invariant); True: on, on
    GPU too; False: nothing is kept between calls (a call's shared prefixes still use the
    cache's mechanism, within the call)."""
    prefix_cache_gib: float | None = None
    """Byte budget of the prefix cache in GiB (its keys and values on the rank that holds
    the most, plus the outputs rank 0 keeps with them); 0 turns the cache and its key-block
    attention off (within-step sharing then runs as without the cache). Unset: 1/8 of the
    machine's memory, at most 4 GiB."""
    prefix_cache_host_gib: float = 0.0
    """The prefix cache's second tier in GiB: host memory (pinned under CUDA) that takes
    the blocks the first tier (``prefix_cache_gib``, device memory) evicts, moved back to
    the device when read (docs/engine.md "Prefix cache"). 0: none."""
    attention_block: int = 64
    """Positions per block of the key-block attention and of the prefix cache (a cache hit
    covers whole blocks; a multiple of the per-sequence pad multiple)."""

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "pipeline_model_parallel_size",
            "pad_to_multiple_of",
            "max_top_k",
            "max_target_ids",
            "logprob_chunk_tokens",
            "min_shared_prefix",
            "attention_block",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.attention_backend == "te" and self.dtype == "float32":
            raise ValueError(
                "attention_backend 'te' needs dtype bfloat16 or float16 (TransformerEngine's "
                "packed-sequence attention has no float32 kernel); use --dtype bfloat16 or "
                "--attention-backend torch"
            )
        if self.lm_head_dtype not in LM_HEAD_DTYPES:
            raise ValueError(
                f"lm_head_dtype must be one of {LM_HEAD_DTYPES}, got {self.lm_head_dtype!r}"
            )
        if self.moe_router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"moe_router_dtype must be one of {ROUTER_DTYPES}, got {self.moe_router_dtype!r}"
            )
        if self.metrics_reduction not in METRICS_REDUCTIONS:
            raise ValueError(
                f"metrics_reduction must be one of {METRICS_REDUCTIONS}, "
                f"got {self.metrics_reduction!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ValueError(
                f"pipeline_microbatches must be >= 1, got {self.pipeline_microbatches}"
            )
        if self.prefix_cache_gib is not None and self.prefix_cache_gib < 0:
            raise ValueError(f"prefix_cache_gib must be >= 0, got {self.prefix_cache_gib}")
        if self.prefix_cache_host_gib < 0:
            raise ValueError(
                f"prefix_cache_host_gib must be >= 0, got {self.prefix_cache_host_gib}"
            )
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be > 0")
        if self.load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be > 0")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        self._check_weights()

    def _check_weights(self) -> None:
        """The weight sets and adapters checked; ``model`` is the default set's."""
        if self.weight_sets not in WEIGHT_SET_POLICIES:
            raise ValueError(
                f"weight_sets must be one of {WEIGHT_SET_POLICIES}, got {self.weight_sets!r}"
            )
        self.weights = tuple(self.weights)
        self.model = self.weight_set_models[0][1]  # the default set's (checks the sets)
        self.adapters = tuple(self.adapters)
        self.adapter_dirs  # noqa: B018 - checks the adapters

    @property
    def weight_set_models(self) -> tuple[tuple[str, str], ...]:
        """``(name, model string)`` of every weight set, the default first.

        Raises:
            ValueError: an entry that is not ``NAME=MODEL``, or a name given twice.
        """
        if not self.weights:
            return ((DEFAULT_WEIGHT_SET, self.model),)
        sets = []
        for entry in self.weights:
            name, sep, model = str(entry).partition("=")
            if not sep or not name.strip() or not model.strip():
                raise ValueError(f"weights: {entry!r} is not NAME=MODEL")
            sets.append((name.strip(), model.strip()))
        names = [name for name, _ in sets]
        if len(set(names)) != len(names):
            raise ValueError(f"weights: a set name is given twice in {names}")
        return tuple(sets)

    @property
    def adapter_dirs(self) -> tuple[tuple[str, str, str], ...]:
        """``(name, directory, weight set)`` of every start-up adapter.

        Raises:
            ValueError: an entry that is not ``NAME=DIR[@SET]``, a name given twice or
                naming a weight set.
        """
        sets = [name for name, _ in self.weight_set_models]
        adapters = []
        for entry in self.adapters:
            name, sep, path = str(entry).partition("=")
            path, at, base = path.strip().rpartition("@")
            if not at or base not in sets:  # an '@' of the directory's own
                path, base = f"{path}{at}{base}", sets[0]
            if not sep or not name.strip() or not path:
                raise ValueError(f"adapters: {entry!r} is not NAME=DIR[@SET]")
            adapters.append((name.strip(), path, base))
        names = [name for name, _, _ in adapters]
        if len(set(names)) != len(names) or set(names) & set(sets):
            raise ValueError(f"adapters: names must differ from each other and the sets': {names}")
        return tuple(adapters)

    def batch_invariant_on(self, device_type: str) -> bool:
        """Whether the step is batch-invariant on a device ("cpu" or "cuda").

        Raises:
            ValueError: ``batch_invariant`` asked for on CUDA.
        """
        if device_type == "cuda":
            if self.batch_invariant:
                raise ValueError(
                    "batch_invariant is CPU-only: cuBLAS and TransformerEngine choose kernels "
                    "by shape (docs/deploy.md, batch invariance on GPUs); drop "
                    "--batch-invariant or serve with --device cpu"
                )
            return False
        return self.batch_invariant is not False

    def sequence_parallel_for(self, is_moe: bool) -> bool:
        """Whether sequence parallelism is on for a model.

        An explicit ``sequence_parallel`` wins. Unset (None), it is on for a MoE model
        with TP > 1: Megatron's training-mode MoE forward, which the MoE / MTP metrics
        need, refuses TP > 1 without it. Dense models keep it off.

        Args:
            is_moe: whether the served model has MoE layers.

        Returns:
            The sequence-parallel setting the model is built with.
        """
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return is_moe and self.tensor_model_parallel_size > 1

    def router_dtype_for(self, family_default: str | None) -> str | None:
        """Megatron's ``moe_router_dtype`` for a model whose family trains its router in
        ``family_default`` (``ModelConfig.moe_router_dtype``): "fp32", "fp64" or None (the
        activations' dtype); an explicit ``moe_router_dtype`` wins over "auto"."""
        if self.moe_router_dtype == "auto":
            return family_default
        return None if self.moe_router_dtype == "model" else self.moe_router_dtype

    def metrics_supported(self, is_moe: bool) -> bool:
        """Whether MoE / MTP metrics can be computed for a model in this layout.

        Megatron's training-mode MoE forward (which the metrics need) refuses TP > 1
        without sequence parallelism, so only an explicit ``sequence_parallel=False``
        for a MoE model at TP > 1 rules them out.

        Args:
            is_moe: whether the served model has MoE layers.
        """
        tp_split = is_moe and self.tensor_model_parallel_size > 1
        return not tp_split or self.sequence_parallel_for(is_moe)

    def pad_multiple(self, is_moe: bool = False) -> int:
        """Per-sequence pad multiple of an engine step: lcm of what CP, SP and the config need.

        ``pad_to_multiple_of``; lcm ``2 * cp`` with CP (``2 * cp`` chunks per sequence);
        lcm ``tp * cp`` with sequence parallelism (tokens split over TP). The engine
        pads with it and the server's batcher budgets padded tokens with it.

        Args:
            is_moe: whether the served model has MoE layers (see
                :meth:`sequence_parallel_for`).

        Returns:
            The multiple every sequence is padded to.
        """
        tp, cp = self.tensor_model_parallel_size, self.context_parallel_size
        multiple = self.pad_to_multiple_of
        if cp > 1:
            multiple = math.lcm(multiple, 2 * cp)
        if self.sequence_parallel_for(is_moe):
            multiple = math.lcm(multiple, tp * cp)
        return multiple

    @property
    def microbatches(self) -> int:
        """Microbatches per step: ``pipeline_microbatches``, else 1 at PP = 1 and 2 x PP."""
        if self.pipeline_microbatches is not None:
            return self.pipeline_microbatches
        pp = self.pipeline_model_parallel_size
        return 1 if pp == 1 else 2 * pp

    @property
    def model_parallel_size(self) -> int:
        """Ranks per replica: TP x CP x PP (EP shares ranks with the data/CP dimension)."""
        return (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )
