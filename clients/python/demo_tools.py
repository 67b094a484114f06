"""Tools for the demo session (loaded by the sidecar through ``settings.toolModules``)."""

from __future__ import annotations

import os
import tempfile

_WEATHER = {"paris": ("light rain", 14), "tokyo": ("clear", 21), "lima": ("overcast", 19)}


def get_weather(city: str) -> dict:
    """Look up the current weather of a city (demo data, no network).

    Args:
        city: the city's name, e.g. Paris
    """
    sky, temp = _WEATHER.get(city.strip().lower(), ("sunny", 20))
    return {"city": city, "sky": sky, "temperature_c": temp}


def save_note(text: str) -> str:
    """Save a short note to the demo's notes file.

    Args:
        text: the note to save
    """
    path = os.path.join(tempfile.gettempdir(), "operate-sidecar-demo-notes.txt")
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text.strip() + "\n")
    return f"saved {len(text)} characters to {path}"
