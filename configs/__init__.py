"""Configuration presets (frozen dataclasses; sweeps derive by ``dataclasses.replace``)."""
