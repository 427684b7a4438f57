"""TextArena's games as marft envs (:mod:`.env`, ``--env_name textarena:<game id>``); textarena is an optional
dependency (``pip install marft[games]``), imported when a game is made."""
