"""The options of the ``channel-scaled`` backend, its published presets and its default layers."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, field_validator, model_validator

from ragfix.backends.base import BackendOptions


@dataclass(frozen=True)
class Preset:
    """Published settings for one model (official code ``configs/*.json``; paper Table 4).

    Attributes:
        channel: index into ``hidden_size``.
        layers: 0-based decoder layers whose attention is scaled.
        factor: the scale of the channel.
        hidden_size, num_layers: the model shape the preset belongs to (checked when applied).
        note: where the paper and the code disagree.
    """

    channel: int
    layers: tuple[int, ...]
    factor: float
    hidden_size: int
    num_layers: int
    note: str = ""


#: preset name -> settings (the code's configs; the paper's variant is given in ``note``)
PRESETS: dict[str, Preset] = {
    "llama-2-7b-chat": Preset(2393, tuple(range(10, 26)), -1.0, 4096, 32),
    "vicuna-7b-v1.5": Preset(2393, tuple(range(10, 26)), 0.0, 4096, 32),
    "vicuna-13b-v1.5": Preset(4923, tuple(range(10, 35)), 0.0, 5120, 40),
    "mistral-7b-instruct-v0.2": Preset(213, tuple(range(10, 26)), 0.0, 4096, 32),
    "qwen1.5-7b-chat": Preset(
        1081, tuple(range(10, 26)), 0.0, 4096, 32, note="paper Table 4: factor 0.2"
    ),
    "gemma-7b-it": Preset(
        1665, tuple(range(10, 26)), 0.0, 3072, 28, note="paper Table 4: layers 10-22"
    ),
}


def default_layers(num_layers: int) -> list[int]:
    """The middle layers: 10-25 of 32 (the paper's choice) scaled to ``num_layers``."""
    start = round(10 * num_layers / 32)
    stop = max(round(26 * num_layers / 32), start + 1)
    return list(range(start, min(stop, num_layers)))


def parse_layers(value: str | int | list[int]) -> list[int]:
    """``"10-25"``, ``"3,5,7-9"``, one int or a list of ints to a sorted list of distinct layer
    indices.

    Raises:
        ValueError: not a layer list (the message quotes the input).
    """
    if isinstance(value, int):
        out = [value]
    elif isinstance(value, list):
        out = value
    else:
        out = []
        try:
            for part in str(value).split(","):
                a, _, b = part.strip().partition("-")
                out.extend(range(int(a), int(b) + 1) if b else [int(a)])
        except ValueError:
            raise ValueError(f"layers {value!r}: expected e.g. '10-25' or '3,5,7-9'") from None
    if not out or any(i < 0 for i in out):
        raise ValueError(f"layers {value!r}: expected non-negative layer indices")
    return sorted(set(out))


class ChannelScalingOptions(BackendOptions):
    """Options of the ``channel-scaled`` backend.

    Attributes:
        calibration: path of a calibration JSON from ``ragfix calibrate``.
        preset: a published setting (one of :data:`PRESETS`).
        channel, layers, factor: explicit settings; each overrides the calibration file / preset.
            ``layers`` is a list or a string like ``"10-25"``; without any source, layers default
            to the middle layers (:func:`default_layers`) and the factor to 0.
    """

    calibration: str | None = None
    preset: str | None = None
    channel: int | None = Field(default=None, ge=0)
    layers: list[int] | str | int | None = None
    factor: float | None = None

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v.lower() not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of: {', '.join(PRESETS)}")
        return v.lower() if v else v

    @field_validator("layers")
    @classmethod
    def _parse_layers(cls, v):
        return None if v is None else parse_layers(v)

    @model_validator(mode="after")
    def _one_source(self):
        if self.calibration and self.preset:
            raise ValueError("give either calibration or preset, not both")
        if not (self.calibration or self.preset) and self.channel is None:
            raise ValueError(
                "channel-scaled needs a calibration file (ragfix calibrate), a preset or a channel"
            )
        return self
