"""Hugging Face safetensors -> jaxspec checkpoint conversion."""
