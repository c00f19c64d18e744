"""The layout planner: which mesh (``dp`` x ``cp`` x ``tp``), checkpointing and loss chunking fit each rank's memory
and train fastest, from the real model's step traced on fake tensors (:func:`plan_layout`)."""

from .profile import PRESETS, DeviceProfile, Link, load_profile, save_profile
from .search import LayoutCandidate, parse_bytes, plan_layout, predict_seconds
from .trace import StepTrace, measure_step, trace_step

__all__ = ["PRESETS", "DeviceProfile", "LayoutCandidate", "Link", "StepTrace", "load_profile", "measure_step",
           "parse_bytes", "plan_layout", "predict_seconds", "save_profile", "trace_step"]
