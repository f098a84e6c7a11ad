"""Typed refusals. Every error names the file / key / tensor, the expected and the actual value.

Hierarchy (catch `DFlashError` for "anything this package refused"):

    DFlashError
      CheckpointError                  files on disk
        CheckpointNotFoundError        missing directory or file          (also a FileNotFoundError)
        GGUFNotSupportedError          a .gguf file was given
        CorruptHeaderError             truncated / unparsable safetensors header
        DataOffsetError                tensor data offsets outside the payload, or not tiling it exactly
        UnknownDTypeError              dtype we do not read
        MissingTensorsError            required tensors absent (lists them)
        UnexpectedTensorsError         tensors we do not know (lists them)
        TensorShapeError               tensor, expected shape, actual shape
        StoredFormatError              a pre-quantized checkpoint (FP8 / compressed-tensors / AWQ / GPTQ) in a
                                       format or scheme not implemented, or inconsistent with its
                                       quantization_config (names file, key, expected, actual)
      ConfigError                      config.json content
        UnknownArchitectureError
        AttentionSinkBiasError         attention_sink_bias: true (no sink path here)
        IsCausalTypeError              is_causal that is not a JSON bool
        UnsupportedConfigError         a feature we would silently get wrong (rope_scaling, biases, ...)
        PairingError                   draft and target disagree (names both values)
        ConfigValueError               a config value of the wrong JSON type or out of range (key, expected, actual)
        ChatTemplateError              a chat template that does not compile, or raises while rendering
      SelectorRefusedError             DFlash2 selector cannot run faithfully (raised at the selector)
      ChatTemplateMissingError         --chat on a model without a chat template
      DeviceUnavailableError           --device cuda with no CUDA device
      GenerationArgumentError          bad sampling / length arguments
        ContextLengthError             prompt / budget that cannot fit (numbers in the message), before allocating
        BlockSizeError                 --block-size / block_size that is not "auto" nor an integer in 2..B
      OutputPathError                  --json PATH that cannot be written (checked before decoding)
      NonFiniteLogitsError             a NaN / Inf logits row (names the step and the position)
      KernelCacheError                 an unreadable file in numba's cache directory (names it)
      KernelArgumentError              kernel called with shapes / sizes it cannot honour  (also a ValueError)
      KernelDTypeError                 kernel called with a dtype mix it does not implement (also a TypeError)
      IsaUnavailableError              DFLASH2_ISA names a path the compile target lacks, or comes too late
      QuantizeError                    a weight that cannot be quantized (names tensor, format, expected, actual)
"""


class DFlashError(Exception):
    """Base class of every refusal raised by dflash2_numba."""


# ---------------------------------------------------------------- checkpoint files
class CheckpointError(DFlashError):
    pass


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    pass


class GGUFNotSupportedError(CheckpointError):
    pass


class CorruptHeaderError(CheckpointError):
    pass


class DataOffsetError(CheckpointError):
    pass


class UnknownDTypeError(CheckpointError):
    pass


class MissingTensorsError(CheckpointError):
    pass


class UnexpectedTensorsError(CheckpointError):
    pass


class TensorShapeError(CheckpointError):
    pass


class StoredFormatError(CheckpointError):
    """A pre-quantized checkpoint we do not compute on as stored (quant/stored.py): an unknown
    quant_method / format / scheme, or tensors that disagree with quantization_config. Names the
    file, the key or tensor, the expected and the actual value; never a dequantize-and-guess."""


# ---------------------------------------------------------------- config content
class ConfigError(DFlashError):
    pass


class UnknownArchitectureError(ConfigError):
    pass


class AttentionSinkBiasError(ConfigError):
    pass


class IsCausalTypeError(ConfigError):
    pass


class UnsupportedConfigError(ConfigError):
    pass


class PairingError(ConfigError):
    pass


class ConfigValueError(ConfigError):
    """A config value of the wrong JSON type or outside its range (names file, key, expected, actual)."""


class ChatTemplateError(ConfigError):
    pass


# ---------------------------------------------------------------- run time
class SelectorRefusedError(DFlashError):
    pass


class ChatTemplateMissingError(DFlashError):
    pass


class DeviceUnavailableError(DFlashError):
    pass


class GenerationArgumentError(DFlashError, ValueError):
    pass


class ContextLengthError(GenerationArgumentError):
    """The prompt or prompt + budget exceeds what the model / this process can hold."""


class BlockSizeError(GenerationArgumentError):
    """A block size that is neither "auto" nor an integer in 2..B (B: the draft's trained block)."""


class OutputPathError(DFlashError):
    pass


class NonFiniteLogitsError(DFlashError):
    """A logits row holds NaN / Inf: the model computed garbage (NaN / Inf weights, overflow)."""


class KernelCacheError(DFlashError):
    pass


# ---------------------------------------------------------------- kernel calls
class KernelArgumentError(DFlashError, ValueError):
    """A kernel got shapes / sizes it cannot honour (names the argument, expected, actual)."""


class KernelDTypeError(DFlashError, TypeError):
    """A kernel got a dtype combination it does not implement (names every argument's dtype)."""


# ---------------------------------------------------------------- instruction sets, quantization
class IsaUnavailableError(DFlashError):
    """DFLASH2_ISA asks for a path above what numba's compile target has (or after numba's
    codegen was built): names the override, the target and its best path."""


class QuantizeError(DFlashError, ValueError):
    """A weight or option that cannot be quantized: names the tensor, the format, expected, actual."""
