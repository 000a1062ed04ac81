"""Hugging Face safetensors on any volume: save, load and export the HF layout.

``_format`` the file format (header), ``_index`` the files and the index,
``_reader`` ``SafetensorsReader``, ``_writer`` ``SafetensorsWriter``,
``_export`` ``export_safetensors``.
"""

from dcp_volumes.safetensors._reader import SafetensorsLoadPlanner

__all__ = ["SafetensorsLoadPlanner"]
