"""Dataset files: safe archive extraction and ImageDirectory validation (no HTTP, no database)."""

from service.datasets.validate import ValidatedDataset, find_data_root, validate_image_directory
from torchyard.contract.archive import ExtractionLimits, extract_archive

__all__ = [
    "ExtractionLimits",
    "ValidatedDataset",
    "extract_archive",
    "find_data_root",
    "validate_image_directory",
]
