"""The data of graphinfer's lm-eval tasks, written for this repository (no download, no licence question): built in
code, deterministically, by lm-eval's `custom_dataset` hook of each task's YAML.

  - graphinfer_capitals (multiple choice, 120 items): "What is the capital of X?", 4 capitals to choose from;
  - graphinfer_arith (multiple choice, 150 items): a + b or a - b with 4 numbers near the answer;
  - graphinfer_arith_gen (generation, 100 items): a + b, answered freely, scored by exact match of the first number.
"""
import random

import datasets

CAPITALS = [
    ("Afghanistan", "Kabul"), ("Albania", "Tirana"), ("Algeria", "Algiers"), ("Argentina", "Buenos Aires"),
    ("Armenia", "Yerevan"), ("Australia", "Canberra"), ("Austria", "Vienna"), ("Azerbaijan", "Baku"),
    ("Bangladesh", "Dhaka"), ("Belarus", "Minsk"), ("Belgium", "Brussels"), ("Bolivia", "Sucre"),
    ("Brazil", "Brasilia"), ("Bulgaria", "Sofia"), ("Cambodia", "Phnom Penh"), ("Cameroon", "Yaounde"),
    ("Canada", "Ottawa"), ("Chile", "Santiago"), ("China", "Beijing"), ("Colombia", "Bogota"),
    ("Costa Rica", "San Jose"), ("Croatia", "Zagreb"), ("Cuba", "Havana"), ("Cyprus", "Nicosia"),
    ("the Czech Republic", "Prague"), ("Denmark", "Copenhagen"), ("Ecuador", "Quito"), ("Egypt", "Cairo"),
    ("Estonia", "Tallinn"), ("Ethiopia", "Addis Ababa"), ("Finland", "Helsinki"), ("France", "Paris"),
    ("Georgia", "Tbilisi"), ("Germany", "Berlin"), ("Ghana", "Accra"), ("Greece", "Athens"),
    ("Guatemala", "Guatemala City"), ("Hungary", "Budapest"), ("Iceland", "Reykjavik"), ("India", "New Delhi"),
    ("Indonesia", "Jakarta"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Ireland", "Dublin"),
    ("Israel", "Jerusalem"), ("Italy", "Rome"), ("Jamaica", "Kingston"), ("Japan", "Tokyo"),
    ("Jordan", "Amman"), ("Kazakhstan", "Astana"), ("Kenya", "Nairobi"), ("Kuwait", "Kuwait City"),
    ("Kyrgyzstan", "Bishkek"), ("Laos", "Vientiane"), ("Latvia", "Riga"), ("Lebanon", "Beirut"),
    ("Libya", "Tripoli"), ("Lithuania", "Vilnius"), ("Luxembourg", "Luxembourg"), ("Madagascar", "Antananarivo"),
    ("Malaysia", "Kuala Lumpur"), ("Mali", "Bamako"), ("Malta", "Valletta"), ("Mexico", "Mexico City"),
    ("Moldova", "Chisinau"), ("Mongolia", "Ulaanbaatar"), ("Morocco", "Rabat"), ("Mozambique", "Maputo"),
    ("Myanmar", "Naypyidaw"), ("Nepal", "Kathmandu"), ("the Netherlands", "Amsterdam"), ("New Zealand", "Wellington"),
    ("Nicaragua", "Managua"), ("Niger", "Niamey"), ("Nigeria", "Abuja"), ("North Korea", "Pyongyang"),
    ("Norway", "Oslo"), ("Oman", "Muscat"), ("Pakistan", "Islamabad"), ("Panama", "Panama City"),
    ("Paraguay", "Asuncion"), ("Peru", "Lima"), ("the Philippines", "Manila"), ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"), ("Qatar", "Doha"), ("Romania", "Bucharest"), ("Russia", "Moscow"),
    ("Rwanda", "Kigali"), ("Saudi Arabia", "Riyadh"), ("Senegal", "Dakar"), ("Serbia", "Belgrade"),
    ("Singapore", "Singapore"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Somalia", "Mogadishu"),
    ("South Africa", "Pretoria"), ("South Korea", "Seoul"), ("Spain", "Madrid"), ("Sri Lanka", "Colombo"),
    ("Sudan", "Khartoum"), ("Sweden", "Stockholm"), ("Switzerland", "Bern"), ("Syria", "Damascus"),
    ("Taiwan", "Taipei"), ("Tajikistan", "Dushanbe"), ("Tanzania", "Dodoma"), ("Thailand", "Bangkok"),
    ("Tunisia", "Tunis"), ("Turkey", "Ankara"), ("Turkmenistan", "Ashgabat"), ("Uganda", "Kampala"),
    ("Ukraine", "Kyiv"), ("the United Arab Emirates", "Abu Dhabi"), ("the United Kingdom", "London"),
    ("the United States", "Washington"), ("Uruguay", "Montevideo"), ("Uzbekistan", "Tashkent"),
    ("Venezuela", "Caracas"), ("Vietnam", "Hanoi"), ("Yemen", "Sanaa"), ("Zambia", "Lusaka"), ("Zimbabwe", "Harare"),
]


def _split(rows: list[dict]) -> dict:
    return {"test": datasets.Dataset.from_list(rows)}


def capitals(**_) -> dict:
    rng = random.Random(0)
    names = [c for _, c in CAPITALS]
    rows = []
    for country, capital in CAPITALS:
        choices = rng.sample([c for c in names if c != capital], 3) + [capital]
        rng.shuffle(choices)
        rows.append({"country": country, "choices": choices, "answer": choices.index(capital)})
    return _split(rows)


def arith(**_) -> dict:
    rng = random.Random(1)
    rows = []
    for _ in range(150):
        a, b, op = rng.randint(2, 60), rng.randint(2, 40), rng.choice("+-")
        value = a + b if op == "+" else a - b
        choices = sorted({value, *rng.sample([value + d for d in (-10, -2, -1, 1, 2, 10)], 3)})
        rows.append({"question": f"{a} {op} {b}", "choices": [str(c) for c in choices], "answer": choices.index(value)})
    return _split(rows)


def arith_gen(**_) -> dict:
    rng = random.Random(2)
    rows = []
    for _ in range(100):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        rows.append({"question": f"What is {a} plus {b}?", "answer": str(a + b)})
    return _split(rows)
