"""What several studies share: `conductor` stages run as a user runs them (stages.py) and what a study's episode
files say (episodes.py)."""
