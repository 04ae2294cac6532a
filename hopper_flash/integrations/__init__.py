"""Integrations of hopper_flash with other libraries.

Each submodule imports its library lazily, so importing ``hopper_flash`` (or
this package) never needs those libraries installed:

* :mod:`hopper_flash.integrations.transformers`: ``register()`` makes
  ``attn_implementation="hopper_flash"`` usable in Hugging Face transformers
  models.
"""
