"""HTML5 game suite with JS verifiers (issue #5 item 4; report section 2.2 "Game Env").

`catalog` lists the games and builds the page scripts (start, state record, snapshot/restore);
`record` is the one JSON schema of verifier records; `reference` holds the scripted reference
players whose scores normalise an agent's (100 x score / reference score).
"""
