"""MLflow's error answer: ``{"error_code": ..., "message": ...}`` with its HTTP status."""

from __future__ import annotations


class MlflowError(Exception):
    def __init__(self, message: str, code: str = "INVALID_PARAMETER_VALUE", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
