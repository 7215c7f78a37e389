"""Offline tools: Hugging Face safetensors -> jaxspec checkpoint conversion, and the export back.

Nothing here runs at inference; `jaxspec` never imports this package at module level.
"""
