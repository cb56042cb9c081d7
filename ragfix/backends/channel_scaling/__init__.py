"""The ``channel-scaled`` method: one positional hidden-state channel scaled in the middle layers
(arXiv 2406.02536).

* :mod:`.options`: :class:`ChannelScalingOptions`, the published presets (:data:`PRESETS`) and
  the default layers.
* :mod:`.backend`: the attention patch (:func:`apply_channel_scaling`), the calibration file
  (:class:`ChannelScalingCalibration`) and :class:`ChannelScalingBackend`.
* :mod:`.calibrate`: ``ragfix calibrate``, the search for the channel and its factor (imported by
  itself: ``ragfix.backends.channel_scaling.calibrate``).
"""

from ragfix.backends.channel_scaling.backend import (
    CALIBRATION_FORMAT,
    SUPPORTED_IMPLEMENTATIONS,
    SUPPORTED_MODEL_TYPES,
    CandidateScore,
    ChannelScaling,
    ChannelScalingBackend,
    ChannelScalingCalibration,
    SettingScore,
    StabilityCheck,
    apply_channel_scaling,
    check_channel_family,
    scaled_keys,
)
from ragfix.backends.channel_scaling.options import (
    PRESETS,
    ChannelScalingOptions,
    Preset,
    default_layers,
    parse_layers,
)

__all__ = [
    "CALIBRATION_FORMAT",
    "PRESETS",
    "SUPPORTED_IMPLEMENTATIONS",
    "SUPPORTED_MODEL_TYPES",
    "CandidateScore",
    "ChannelScaling",
    "ChannelScalingBackend",
    "ChannelScalingCalibration",
    "ChannelScalingOptions",
    "Preset",
    "SettingScore",
    "StabilityCheck",
    "apply_channel_scaling",
    "check_channel_family",
    "default_layers",
    "parse_layers",
    "scaled_keys",
]
