"""LoRA adapters: every on-disk format parsed into one canonical, validated adapter."""
from moelora.lora.adapter import AdapterFile, canonicalize, load_adapter, read_adapter
from moelora.lora.canonical import Adapter, ExpertsLoRA, LayerLoRA, LinearLoRA
from moelora.lora.config import AdapterConfig
from moelora.lora.errors import AdapterError
from moelora.lora.model_shapes import ModelShapes, load_model_shapes

__all__ = ["Adapter", "AdapterConfig", "AdapterError", "AdapterFile", "ExpertsLoRA", "LayerLoRA", "LinearLoRA",
           "ModelShapes", "canonicalize", "load_adapter", "load_model_shapes", "read_adapter"]
