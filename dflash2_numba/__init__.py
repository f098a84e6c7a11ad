"""dflash2_numba: lossless speculative decoding with DFlash / DFlash2 drafts in numpy + numba.

    import dflash2_numba as dn
    target = dn.load_target("models/Qwen3-8B")                    # HF dir (+ target.tokenizer)
    draft  = dn.load_draft("models/Qwen3-8B-DFlash-b16", target)  # v1 or v2, decided by config
    for step in dn.stream_generate(target, draft, "prompt", max_new_tokens=256):
        print(step.text, end="", flush=True)
    result = dn.generate(target, None, "prompt")                  # draft=None: target-only

Importing the package is cheap: models and kernels load on first use.
"""

from .kernels.isa import apply_override as _apply_isa_override

_apply_isa_override()  # DFLASH2_ISA must reach numba's config before anything compiles

from .api import draft_kind, load_draft, load_target
from .decode.drafter import Drafter, OracleDrafter, Proposal
from .decode.loop import GenerationResult, StepResult, generate, propose_once, stream_generate
from .decode.sampling import SamplingParams
from .decode.stats import DecodeStats
from .errors import (AttentionSinkBiasError, ChatTemplateMissingError, CheckpointError,
                     CheckpointNotFoundError, ConfigError, DeviceUnavailableError, DFlashError,
                     GenerationArgumentError, GGUFNotSupportedError, IsCausalTypeError,
                     MissingTensorsError, PairingError, SelectorRefusedError, TensorShapeError,
                     UnexpectedTensorsError, UnknownArchitectureError, UnsupportedConfigError,
                     BlockSizeError, ChatTemplateError, ConfigValueError, ContextLengthError, CorruptHeaderError,
                     DataOffsetError, KernelCacheError, NonFiniteLogitsError, OutputPathError,
                     UnknownDTypeError, IsaUnavailableError, QuantizeError)

__version__ = "0.1.0"

__all__ = [
    "load_target", "load_draft", "draft_kind", "stream_generate", "generate", "propose_once",
    "StepResult", "GenerationResult", "SamplingParams", "DecodeStats", "Drafter", "Proposal",
    "OracleDrafter", "DFlashError", "CheckpointError", "CheckpointNotFoundError",
    "GGUFNotSupportedError", "MissingTensorsError", "UnexpectedTensorsError", "TensorShapeError",
    "ConfigError", "UnknownArchitectureError", "AttentionSinkBiasError", "IsCausalTypeError",
    "UnsupportedConfigError", "PairingError", "SelectorRefusedError", "ChatTemplateMissingError",
    "DeviceUnavailableError", "GenerationArgumentError", "ChatTemplateError", "ConfigValueError",
    "ContextLengthError", "BlockSizeError", "CorruptHeaderError", "DataOffsetError", "KernelCacheError",
    "NonFiniteLogitsError", "OutputPathError", "UnknownDTypeError", "IsaUnavailableError", "QuantizeError",
]
