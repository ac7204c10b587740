"""The ``capgate`` sub-commands that run the gateway's parts without serving agents.

=====================  ===============================================================
module                 command
=====================  ===============================================================
``explain.py``         ``capgate policy explain``: one decision, through the real stages
``policy_tests.py``    ``capgate policy test``: YAML test cases through the policy
``regression.py``      ``capgate policy test`` on a recording: its traffic through a new policy
``recording.py``       ``capgate recording ...`` and ``capgate replay DIR -- COMMAND``
``sandbox.py``         ``capgate sandbox run``: a command whose only way out is the gateway
``ci_token.py``        the token ``replay`` and ``sandbox run`` mint for CI (``--agent ...``)
=====================  ===============================================================
"""
