"""Adapters that plug tangram into RL frameworks in-process.

Each adapter lives in its own module and imports its framework there, so ``import
tangram`` never needs one: ``tangram.integrations.verl`` needs verl,
``tangram.integrations.skyrl`` needs skyrl-gym.
"""
