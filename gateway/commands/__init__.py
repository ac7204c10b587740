"""The ``capgate`` sub-commands that run the gateway's parts without serving agents.

=====================  ===============================================================
module                 command
=====================  ===============================================================
``explain.py``         ``capgate policy explain``: one decision, through the real stages
``regression.py``      ``capgate policy test``: recorded traffic through a new policy
``recording.py``       ``capgate recording ...`` and ``capgate replay DIR -- COMMAND``
=====================  ===============================================================
"""
