"""One package per question a study answers; each runs as `python -m benchmarks.studies.<study>.bench`.

    credit     credit quality against Monte Carlo truth (bench), its sampling (stages), scores and pooling
    learning   a learning curve that rises: plate_reading, outcome vs turn credit (bench), its summary maths
    horizon    plate_audit at N photos per episode x credit mode (bench), the study's power
    reader     page_qa's reader on a tune and a report split (bench), its questions (items), its rule (rules)
    rl         base vs SFT vs RL, the whole chain (bench); the shipped default policy against its base model

What several studies share is in benchmarks/common/; every record and table lands in
benchmarks/results/<study>/<run>/.
"""
