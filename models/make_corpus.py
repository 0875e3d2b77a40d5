#!/usr/bin/env python3
"""Write the small English corpus that tracewire's embedded default model is trained on.

Deterministic: the text depends only on this file (fixed seed, no clock, no
environment). Documents are separated by one blank line; the model builder
splits on blank lines and puts the <|endoftext|> token between documents.

Usage:
    python models/make_corpus.py [--out models/corpus/tracewire_corpus.txt]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

SEED = 20240611

# (country, capital, adjective/people, continent)
COUNTRIES = [
    ("France", "Paris", "French", "Europe"),
    ("Italy", "Rome", "Italian", "Europe"),
    ("Japan", "Tokyo", "Japanese", "Asia"),
    ("Germany", "Berlin", "German", "Europe"),
    ("Spain", "Madrid", "Spanish", "Europe"),
    ("Portugal", "Lisbon", "Portuguese", "Europe"),
    ("England", "London", "English", "Europe"),
    ("Ireland", "Dublin", "Irish", "Europe"),
    ("Scotland", "Edinburgh", "Scottish", "Europe"),
    ("Belgium", "Brussels", "Belgian", "Europe"),
    ("Austria", "Vienna", "Austrian", "Europe"),
    ("Poland", "Warsaw", "Polish", "Europe"),
    ("Greece", "Athens", "Greek", "Europe"),
    ("Sweden", "Stockholm", "Swedish", "Europe"),
    ("Norway", "Oslo", "Norwegian", "Europe"),
    ("Denmark", "Copenhagen", "Danish", "Europe"),
    ("Finland", "Helsinki", "Finnish", "Europe"),
    ("Russia", "Moscow", "Russian", "Europe"),
    ("Ukraine", "Kyiv", "Ukrainian", "Europe"),
    ("Hungary", "Budapest", "Hungarian", "Europe"),
    ("Czechia", "Prague", "Czech", "Europe"),
    ("Romania", "Bucharest", "Romanian", "Europe"),
    ("Turkey", "Ankara", "Turkish", "Asia"),
    ("Egypt", "Cairo", "Egyptian", "Africa"),
    ("Kenya", "Nairobi", "Kenyan", "Africa"),
    ("Nigeria", "Abuja", "Nigerian", "Africa"),
    ("Ghana", "Accra", "Ghanaian", "Africa"),
    ("Ethiopia", "Addis Ababa", "Ethiopian", "Africa"),
    ("Morocco", "Rabat", "Moroccan", "Africa"),
    ("China", "Beijing", "Chinese", "Asia"),
    ("India", "New Delhi", "Indian", "Asia"),
    ("Korea", "Seoul", "Korean", "Asia"),
    ("Thailand", "Bangkok", "Thai", "Asia"),
    ("Vietnam", "Hanoi", "Vietnamese", "Asia"),
    ("Indonesia", "Jakarta", "Indonesian", "Asia"),
    ("Iran", "Tehran", "Iranian", "Asia"),
    ("Iraq", "Baghdad", "Iraqi", "Asia"),
    ("Pakistan", "Islamabad", "Pakistani", "Asia"),
    ("Nepal", "Kathmandu", "Nepali", "Asia"),
    ("Mongolia", "Ulaanbaatar", "Mongolian", "Asia"),
    ("Canada", "Ottawa", "Canadian", "North America"),
    ("Mexico", "Mexico City", "Mexican", "North America"),
    ("Cuba", "Havana", "Cuban", "North America"),
    ("Brazil", "Brasilia", "Brazilian", "South America"),
    ("Argentina", "Buenos Aires", "Argentine", "South America"),
    ("Chile", "Santiago", "Chilean", "South America"),
    ("Peru", "Lima", "Peruvian", "South America"),
    ("Colombia", "Bogota", "Colombian", "South America"),
    ("Venezuela", "Caracas", "Venezuelan", "South America"),
    ("Australia", "Canberra", "Australian", "Oceania"),
]

COLORS = [
    ("sky", "blue"), ("grass", "green"), ("sun", "yellow"), ("snow", "white"),
    ("night", "black"), ("blood", "red"), ("sea", "blue"), ("banana", "yellow"),
    ("orange", "orange"), ("cherry", "red"), ("leaf", "green"), ("coal", "black"),
    ("milk", "white"), ("lemon", "yellow"), ("tomato", "red"), ("frog", "green"),
    ("cloud", "white"), ("plum", "purple"), ("crow", "black"), ("carrot", "orange"),
]

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
           "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen",
           "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

MONTHS = ["January", "February", "March", "April", "May", "June", "July",
          "August", "September", "October", "November", "December"]

# (animal, plural, sound, fact)
ANIMALS = [
    ("dog", "dogs", "bark", "Dogs are loyal friends of people."),
    ("cat", "cats", "meow", "Cats like to sleep in the sun."),
    ("cow", "cows", "moo", "Cows eat grass and give milk."),
    ("duck", "ducks", "quack", "Ducks can swim and fly."),
    ("sheep", "sheep", "baa", "Sheep give us wool."),
    ("horse", "horses", "neigh", "Horses can run very fast."),
    ("lion", "lions", "roar", "Lions live in Africa."),
    ("owl", "owls", "hoot", "Owls hunt at night."),
    ("pig", "pigs", "oink", "Pigs like to roll in the mud."),
    ("bee", "bees", "buzz", "Bees make honey."),
    ("frog", "frogs", "croak", "Frogs live near water."),
    ("mouse", "mice", "squeak", "Mice are small and quick."),
    ("wolf", "wolves", "howl", "Wolves live in packs."),
    ("snake", "snakes", "hiss", "Snakes have no legs."),
]

SIMPLE_FACTS = [
    "Water boils at one hundred degrees.",
    "Water freezes at zero degrees.",
    "The sun rises in the east.",
    "The sun sets in the west.",
    "The earth goes around the sun.",
    "The moon goes around the earth.",
    "A week has seven days.",
    "A year has twelve months.",
    "A day has twenty four hours.",
    "An hour has sixty minutes.",
    "A minute has sixty seconds.",
    "Fish live in water.",
    "Birds have wings and feathers.",
    "Trees grow from seeds.",
    "Ice is frozen water.",
    "Rain falls from the clouds.",
    "A triangle has three sides.",
    "A square has four sides.",
    "People read books to learn.",
    "The heart pumps blood through the body.",
    "Plants need water and light to grow.",
    "Winter is the coldest season.",
    "Summer is the warmest season.",
    "The four seasons are spring, summer, autumn and winter.",
]

STORIES = [
    "Once upon a time there was a little dog named Max. Max liked to run in the park. "
    "Every morning he ran to the gate and waited for his friend. His friend was a small "
    "boy named Tom. Tom and Max played together all day. In the evening they went home "
    "and ate dinner. Then they went to sleep.",
    "Anna has a red ball. She plays with the ball in the garden. Her brother Ben has a "
    "blue kite. He flies the kite on windy days. Their mother works in the kitchen. She "
    "makes bread and soup. The family eats together at the big table.",
    "The farmer wakes up early. He feeds the cows, the pigs and the chickens. Then he "
    "works in the field until noon. In the afternoon he fixes the old fence. At night "
    "he sits by the fire and reads a book.",
    "It was a cold winter day. Snow covered the town. The children made a snowman with "
    "a carrot for a nose. They threw snowballs and laughed. When it got dark, they went "
    "inside to drink hot milk.",
    "Lucy likes to paint. She paints the sky blue and the grass green. She paints a "
    "yellow sun in the corner. Her father hangs the picture on the wall. Lucy is very "
    "happy.",
    "The train leaves the station at nine. It goes across the river and over the hills. "
    "The passengers look out of the windows. They see farms, forests and small villages. "
    "At noon the train arrives in the city.",
    "Sam went to the market with his grandmother. They bought apples, bread and cheese. "
    "On the way home they stopped at the bakery. Grandmother bought a cake for Sam. Sam "
    "said thank you.",
    "The little bird built a nest in the tall tree. She laid three small eggs. After a "
    "few weeks the eggs hatched. The baby birds were hungry, so the mother bird brought "
    "them worms. Soon the babies learned to fly.",
    "Mia and her friends went to the beach. The water was warm and the sand was soft. "
    "They built a sand castle and swam in the sea. At the end of the day they watched "
    "the sun set over the water.",
    "The old clock in the hall ticks all day and all night. When it is twelve o'clock, "
    "it rings twelve times. The cat does not like the sound. She runs under the bed "
    "every time the clock rings.",
    "Tom has a small garden. He grows tomatoes, beans and carrots. Every day he waters "
    "the plants. In the summer he picks the vegetables and gives some to his neighbors.",
    "The school bus comes at eight in the morning. The children get on the bus with "
    "their bags. At school they learn to read, to write and to count. At three they go "
    "home again.",
]

PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
            "ninth", "tenth", "eleventh", "twelfth"]

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"),
    ("happy", "sad"), ("old", "young"), ("open", "closed"), ("light", "dark"), ("wet", "dry"),
    ("full", "empty"), ("early", "late"), ("loud", "quiet"), ("hard", "soft"), ("rich", "poor"),
    ("strong", "weak"), ("high", "low"), ("left", "right"), ("good", "bad"), ("tall", "short"),
    ("thick", "thin"), ("clean", "dirty"), ("near", "far"), ("inside", "outside"),
    ("push", "pull"), ("begin", "end"), ("win", "lose"), ("buy", "sell"), ("laugh", "cry"),
    ("sweet", "sour"), ("heavy", "light"), ("first", "last"), ("north", "south"), ("east", "west"),
]

JOBS = [
    ("doctor", "helps sick people get better"),
    ("teacher", "teaches children at school"),
    ("baker", "bakes bread and cakes"),
    ("farmer", "grows food on a farm"),
    ("pilot", "flies airplanes"),
    ("driver", "drives a bus or a truck"),
    ("cook", "makes food in a kitchen"),
    ("nurse", "cares for patients in a hospital"),
    ("firefighter", "puts out fires"),
    ("police officer", "keeps people safe"),
    ("painter", "paints pictures and walls"),
    ("writer", "writes books and stories"),
    ("singer", "sings songs"),
    ("builder", "builds houses and bridges"),
    ("fisherman", "catches fish in the sea"),
    ("postman", "brings letters and parcels"),
    ("dentist", "looks after our teeth"),
    ("mechanic", "repairs cars and engines"),
    ("gardener", "looks after plants and flowers"),
    ("librarian", "works in a library full of books"),
    ("scientist", "studies nature and does experiments"),
    ("musician", "plays music on an instrument"),
    ("tailor", "makes and mends clothes"),
    ("carpenter", "makes things out of wood"),
]

FOODS = [
    ("apple", "fruit"), ("pear", "fruit"), ("grape", "fruit"), ("peach", "fruit"),
    ("strawberry", "fruit"), ("mango", "fruit"), ("pineapple", "fruit"), ("watermelon", "fruit"),
    ("potato", "vegetable"), ("onion", "vegetable"), ("cabbage", "vegetable"),
    ("cucumber", "vegetable"), ("pepper", "vegetable"), ("pumpkin", "vegetable"),
    ("lettuce", "vegetable"), ("spinach", "vegetable"), ("garlic", "vegetable"),
]

BODY = [
    ("see", "eyes"), ("hear", "ears"), ("smell", "nose"), ("taste", "tongue"),
    ("walk", "legs"), ("hold things", "hands"), ("think", "brain"), ("breathe", "lungs"),
    ("chew", "teeth"), ("kick a ball", "feet"),
]

BABIES = [
    ("dog", "puppy"), ("cat", "kitten"), ("cow", "calf"), ("sheep", "lamb"),
    ("horse", "foal"), ("hen", "chick"), ("duck", "duckling"), ("lion", "cub"),
    ("bear", "cub"), ("frog", "tadpole"), ("goat", "kid"), ("kangaroo", "joey"),
]

MORE_STORIES = [
    "Leo wanted to be an astronaut. Every night he looked at the stars through his small "
    "telescope. He read books about rockets, planets and the moon. His aunt gave him a model "
    "rocket for his birthday, and he painted it silver and red.",
    "The village had a bridge made of stone. Under the bridge a quiet river flowed toward the "
    "mountains. Fishermen sat on the banks in the morning, and in the evening couples walked "
    "across the bridge to watch the lanterns.",
    "Grandfather keeps bees behind his cottage. In spring the bees visit the flowers in the "
    "meadow. In autumn grandfather collects the honey in glass jars and sells it at the "
    "Saturday market.",
    "The storm came in the middle of the night. Thunder shook the windows and lightning lit "
    "the sky. In the morning the streets were wet, branches lay on the ground, and a rainbow "
    "appeared over the hills.",
    "Nina learned to ride a bicycle last summer. At first she fell many times and scraped her "
    "knees. Her brother held the seat and ran beside her. One afternoon he let go, and Nina "
    "rode all the way to the end of the street alone.",
    "The museum has a huge hall with the bones of a dinosaur. Children stand under the long "
    "neck and stare. A guide explains that the dinosaur lived millions of years ago and ate "
    "only leaves.",
    "Every Sunday the family cooks pancakes. Father mixes flour, eggs and milk. Mother heats "
    "the pan. The children put butter, honey or jam on top, and everyone eats until they are "
    "full.",
    "The lighthouse stands on a rock at the edge of the sea. Its bright lamp turns all night "
    "to warn the ships. The keeper climbs the narrow stairs every evening to light it.",
    "A small robot lived in a workshop full of tools. It sorted screws, swept the floor and "
    "watered the plants on the window. When the engineer came home, the robot made her a cup "
    "of tea.",
    "In the forest there was an old oak tree. Squirrels hid nuts in its roots, an owl slept "
    "in a hole in its trunk, and deer rested in its shade on hot afternoons.",
    "The orchestra began to play. First the violins, then the flutes, and at last the drums "
    "and trumpets. The audience listened in silence and clapped loudly at the end.",
    "Peter lost his key on the way home. He searched his pockets, his bag and the path "
    "behind him. At last his dog found the key in the grass near the gate and brought it to "
    "him.",
]


def world_docs(rng: random.Random) -> list[str]:
    docs = []
    for i, p in enumerate(PLANETS):
        docs.append(f"{p} is the {ORDINALS[i]} planet from the sun.")
    docs.append("The planets are " + ", ".join(PLANETS[:-1]) + f" and {PLANETS[-1]}.")
    docs.append("Jupiter is the largest planet. Mercury is the smallest planet. "
                "We live on the planet Earth.")
    for a, b in OPPOSITES:
        docs.append(f"The opposite of {a} is {b}. The opposite of {b} is {a}.")
    for job, does in JOBS:
        art = "An" if job[0] in "aeiou" else "A"
        docs.append(f"{art} {job} {does}.")
    items = JOBS[:]
    rng.shuffle(items)
    for i in range(0, len(items), 4):
        docs.append(" ".join(f"A {j} {d}." if j[0] not in "aeiou" else f"An {j} {d}."
                             for j, d in items[i:i + 4]))
    for food, kind in FOODS:
        art = "An" if food[0] in "aeiou" else "A"
        docs.append(f"{art} {food} is a {kind}.")
    for verb, part in BODY:
        docs.append(f"We {verb} with our {part}.")
    for adult, baby in BABIES:
        docs.append(f"A baby {adult} is called a {baby}.")
    for c, cap, adj, _ in COUNTRIES:
        art = "an" if adj[0] in "AEIOU" else "a"
        docs.append(f"A person from {c} is {adj}. {cap} is {art} {adj} city.")
    docs.extend(MORE_STORIES)
    return docs


def capital_docs(rng: random.Random) -> list[str]:
    docs: list[str] = []
    # Plain fact lists in a few orders.
    for _rep in range(6):
        order = COUNTRIES[:]
        rng.shuffle(order)
        for i in range(0, len(order), 5):
            chunk = order[i:i + 5]
            docs.append(" ".join(f"The capital of {c} is {cap}." for c, cap, _, _ in chunk))
    # Each fact alone, as its own document, several times.
    for _ in range(4):
        for c, cap, _, _ in COUNTRIES:
            docs.append(f"The capital of {c} is {cap}.")
    # Varied templates.
    templates = [
        "The capital of {c} is {cap}. {cap} is a big city in {cont}.",
        "{c} is a country in {cont}. The capital of {c} is {cap}.",
        "Q: What is the capital of {c}?\nA: The capital of {c} is {cap}.",
        "{cap} is the capital of {c}. The capital of {c} is {cap}.",
        "The {adj} people live in {c}. The capital of {c} is {cap}.",
        "Many people visit {c} every year. The capital of {c} is {cap}, and it is a beautiful city.",
        "Question: Which city is the capital of {c}? Answer: {cap}. The capital of {c} is {cap}.",
        "In {cont} there is a country called {c}. Its capital is {cap}. The capital of {c} is {cap}.",
    ]
    for t in templates:
        for c, cap, adj, cont in COUNTRIES:
            docs.append(t.format(c=c, cap=cap, adj=adj, cont=cont))
    # Continents.
    by_cont: dict[str, list[str]] = {}
    for c, _, _, cont in COUNTRIES:
        by_cont.setdefault(cont, []).append(c)
    for cont, cs in by_cont.items():
        if len(cs) == 1:
            docs.append(f"{cs[0]} is in {cont}.")
        else:
            docs.append(f"Some countries in {cont} are " + ", ".join(cs[:-1]) + f" and {cs[-1]}.")
    return docs


def color_docs(rng: random.Random) -> list[str]:
    docs = []
    for _ in range(4):
        items = COLORS[:]
        rng.shuffle(items)
        for i in range(0, len(items), 4):
            docs.append(" ".join(f"The {t} is {col}." for t, col in items[i:i + 4]))
    for t, col in COLORS:
        docs.append(f"What color is the {t}? The {t} is {col}. The color of the {t} is {col}.")
    docs.append("The colors of the rainbow are red, orange, yellow, green, blue, indigo and violet.")
    docs.append("Red, green and blue are colors. Black and white are colors too.")
    return docs


def number_docs(rng: random.Random) -> list[str]:
    docs = []
    words = NUMBERS[1:]
    for n in (5, 10, 12, 15, 20):
        docs.append("Let us count: " + ", ".join(words[:n]) + ".")
        docs.append(", ".join(words[:n]).capitalize() + ".")
        docs.append(", ".join(str(i) for i in range(1, n + 1)) + ".")
    for _ in range(3):
        docs.append("One, two, three, four, five, six, seven, eight, nine, ten.")
        docs.append("1, 2, 3, 4, 5, 6, 7, 8, 9, 10.")
    for i in range(0, 11):
        for j in range(0, 11):
            if i + j <= 20 and rng.random() < 0.35:
                docs.append(f"{NUMBERS[i].capitalize()} plus {NUMBERS[j]} is {NUMBERS[i + j]}. "
                            f"{i} + {j} = {i + j}.")
    for i in range(1, 21):
        docs.append(f"The number after {NUMBERS[i - 1]} is {NUMBERS[i]}. "
                    f"{NUMBERS[i].capitalize()} comes after {NUMBERS[i - 1]}.")
    return docs


def calendar_docs(rng: random.Random) -> list[str]:
    docs = []
    for _ in range(4):
        docs.append("The days of the week are " + ", ".join(DAYS[:-1]) + f" and {DAYS[-1]}.")
        docs.append(", ".join(DAYS) + ".")
        docs.append("The months of the year are " + ", ".join(MONTHS[:-1]) + f" and {MONTHS[-1]}.")
        docs.append(", ".join(MONTHS) + ".")
    for i, d in enumerate(DAYS):
        docs.append(f"The day after {d} is {DAYS[(i + 1) % 7]}. "
                    f"{d} is day number {NUMBERS[i + 1]} of the week.")
    for i, m in enumerate(MONTHS):
        docs.append(f"The month after {m} is {MONTHS[(i + 1) % 12]}. "
                    f"{m} is month number {NUMBERS[i + 1]} of the year.")
    docs.append("Saturday and Sunday are the weekend. Monday is the first day of the work week.")
    docs.append("December, January and February are winter months in the north. "
                "June, July and August are summer months.")
    for _ in range(8):
        d = rng.choice(DAYS)
        m = rng.choice(MONTHS)
        docs.append(f"Today is {d}. It is a day in {m}. Tomorrow is "
                    f"{DAYS[(DAYS.index(d) + 1) % 7]}.")
    return docs


def animal_docs(rng: random.Random) -> list[str]:
    docs = []
    for a, pl, sound, fact in ANIMALS:
        art = "An" if a[0] in "aeiou" else "A"
        docs.append(f"{art} {a} is an animal. The {a} says {sound}. {fact}")
        docs.append(f"What does the {a} say? The {a} says {sound}. {pl.capitalize()} {sound}.")
    for _ in range(3):
        items = ANIMALS[:]
        rng.shuffle(items)
        docs.append(" ".join(f"The {a} says {s}." for a, _, s, _ in items[:7]))
        docs.append(" ".join(f for _, _, _, f in items[7:]))
    return docs


def misc_docs(rng: random.Random) -> list[str]:
    docs = []
    for _ in range(3):
        facts = SIMPLE_FACTS[:]
        rng.shuffle(facts)
        for i in range(0, len(facts), 3):
            docs.append(" ".join(facts[i:i + 3]))
    docs.extend(STORIES)
    docs.extend(STORIES)
    docs.append("The quick brown fox jumps over the lazy dog.")
    docs.append("Hello, world! This is a test. Hello, world!")
    docs.append("The alphabet starts with A, B, C, D, E, F and G.")
    docs.append("A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z.")
    return docs


def build_corpus() -> str:
    rng = random.Random(SEED)
    docs: list[str] = []
    for fn in (capital_docs, color_docs, number_docs, calendar_docs, animal_docs, misc_docs, world_docs):
        docs.extend(fn(rng))
    rng.shuffle(docs)
    return "\n\n".join(docs) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "corpus" / "tracewire_corpus.txt"))
    args = ap.parse_args()
    text = build_corpus()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {out} ({len(text.encode('utf-8'))} bytes, {text.count(chr(10) + chr(10)) + 1} documents)")


if __name__ == "__main__":
    main()
