"""The ``ugro`` command's commands, one module each (``ugro/commands/<command>.py``): the module parses the
command's options, calls the room that does the work (ugro/run/, ugro/checks/, ugro/model/, ugro/monitoring/,
ugro/schedulers/) and prints what it found. Each module has ``register(app)``, which adds its command(s) to the
app under their user-facing names; ugro/cli.py builds the app from them in the order of ``ugro --help``.

``common.py`` holds what several commands share (consoles, options, the error line); ``options.py`` builds a
command whose many options are declared as one dataclass.
"""
