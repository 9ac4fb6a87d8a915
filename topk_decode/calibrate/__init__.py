"""Calibration of strategy artifacts from the model itself (e.g. DuoAttention's head gates)."""

from __future__ import annotations

from topk_decode.calibrate.duo import (
    DuoCalibrationConfig,
    DuoCalibrationResult,
    calibrate_duo,
    calibrate_duo_to_file,
    passkey_sample,
)

__all__ = ["DuoCalibrationConfig", "DuoCalibrationResult", "calibrate_duo", "calibrate_duo_to_file", "passkey_sample"]
