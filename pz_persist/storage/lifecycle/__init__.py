"""What surrounds checkpoints over time: saves under way, what unfinished ones
left, and the steps of an Orbax run directory.

`leftovers` marks a save while it writes and finds and removes what a killed
or interrupted save left (``pz-persist clean``); `steps` names and lists the
steps of a ``CheckpointManager`` directory (``pz-persist ls``) and chooses how
Orbax writes one on each store. Imports only `integrity`, `stores` and the
Orbax seam below it.
"""
