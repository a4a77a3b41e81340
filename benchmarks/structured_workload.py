"""Five non-trivial JSON schemas and 50 extraction lines over them (10 per schema), as an OpenAI
batch file. Shared by ``benchmarks/structured.py`` and the tests.

The schemas use what extraction and classification jobs use: nested objects, arrays with
``minItems``/``maxItems``, enums, bounded integers and numbers, string patterns, ``maxLength`` and
required fields, all ``strict`` (``additionalProperties: false``)."""

from __future__ import annotations

import json
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "country": {"type": "string", "maxLength": 30},
                },
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "email", "address"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "mixed"]},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "aspects": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "aspect": {"type": "string", "enum": ["price", "quality", "delivery", "service"]},
                        "polarity": {"type": "string", "enum": ["good", "bad"]},
                    },
                    "required": ["aspect", "polarity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["sentiment", "rating", "aspects"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
            "attendees": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {"type": "string", "maxLength": 30},
            },
            "online": {"type": "boolean"},
        },
        "required": ["title", "date", "attendees", "online"],
        "additionalProperties": False,
    },
    "recipe": {
        "type": "object",
        "properties": {
            "dish": {"type": "string", "maxLength": 40},
            "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": {
                "type": "array",
                "minItems": 2,
                "maxItems": 6,
                "items": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "string", "maxLength": 24},
                        "grams": {"type": "integer", "minimum": 1, "maximum": 2000},
                    },
                    "required": ["item", "grams"],
                    "additionalProperties": False,
                },
            },
            "vegetarian": {"type": "boolean"},
        },
        "required": ["dish", "servings", "ingredients", "vegetarian"],
        "additionalProperties": False,
    },
    "ticket": {
        "type": "object",
        "properties": {
            "ticket_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
            "category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
                },
                "required": ["name", "tier"],
                "additionalProperties": False,
            },
            "summary": {"type": "string", "maxLength": 80},
        },
        "required": ["ticket_id", "priority", "category", "customer", "summary"],
        "additionalProperties": False,
    },
}

TEXTS: dict[str, list[str]] = {
    "person": [
        "Maria Lopez, 34, lives in Madrid, Spain. Write to maria@mail.com.",
        "Our new hire is Tom Becker (age 27) from Berlin, Germany; tom@work.org.",
        "Contact: Aiko Tanaka, 45 years old, Osaka, Japan, aiko@home.net",
        "James O'Neil is 61 and retired to Dublin, Ireland. Email james@post.com.",
        "Priya Shah, twenty-nine, based in Mumbai, India (priya@shah.org).",
        "Lars Nilsen, 52, Oslo, Norway. lars@fjord.net",
        "The speaker, Chen Wei (38), flew in from Shanghai, China; chen@talks.com.",
        "Fatima Zahra, 23, student in Rabat, Morocco, fatima@uni.org.",
        "Pierre Dubois, aged 70, Lyon, France — pierre@vin.net",
        "Sofia Rossi (41) runs a shop in Rome, Italy. sofia@shop.com",
    ],
    "review": [
        "Great quality for the price, but delivery took three weeks.",
        "Terrible service, the support agent hung up on me. One star.",
        "Arrived next day, works perfectly, cheap too. Five stars!",
        "The fabric feels cheap and it tore after a week.",
        "Good value. Customer service was friendly and quick.",
        "Expensive, but the build quality is outstanding.",
        "Package was damaged and the refund process was painful.",
        "Decent product, slow shipping, helpful staff.",
        "Not worth the money at all; broke on day two.",
        "Exactly as described, fast delivery, fair price.",
    ],
    "event": [
        "Team offsite on 2026-03-14 with Ana, Ben and Carla, in person at the lake house.",
        "Webinar 'Scaling Redis' on 2026-11-02, hosted online by Dev and Priya.",
        "Board meeting 2025-12-01; attendees: the CEO, the CFO and two directors. Held in the office.",
        "Product launch livestream on 2027-01-20 with Marta and Jun.",
        "Wedding of Leo and Mia on 2026-06-06 at the old chapel.",
        "Online book club, 2026-02-28, with Sam, Rita, Omar and Lee.",
        "Quarterly review 2026-04-01 in room 4B with Alex and Kim.",
        "Hackathon kickoff 2026-09-12, remote, with the platform team.",
        "Charity run on 2026-05-17 in the park; volunteers Zoe and Ivan.",
        "Design sprint demo, 2026-08-08, video call with Noor and Eli.",
    ],
    "recipe": [
        "Pancakes for 4: 200 g flour, 300 g milk, 100 g eggs, 20 g sugar.",
        "Tomato soup serves 2: 500 g tomatoes, 100 g onion, 10 g salt.",
        "Beef stew for 6 people: 800 g beef, 300 g carrots, 400 g potatoes.",
        "Guacamole (serves 3): 400 g avocado, 50 g lime, 5 g salt, 30 g onion.",
        "Chicken curry for 4: 600 g chicken, 400 g coconut milk, 30 g curry paste.",
        "Fruit salad for 5: 300 g apples, 200 g grapes, 250 g melon.",
        "Omelette for 1: 150 g eggs, 30 g cheese, 10 g butter.",
        "Lentil dal for 4: 250 g lentils, 100 g onion, 20 g ginger, 400 g water.",
        "Brownies, 12 pieces: 200 g chocolate, 150 g butter, 180 g sugar, 100 g flour.",
        "Caesar salad for 2: 200 g lettuce, 50 g parmesan, 60 g croutons, 80 g chicken.",
    ],
    "ticket": [
        "Ticket ABC-1042, urgent: enterprise customer Dana Fox cannot log in since the update.",
        "Ticket XYZ-0007 (low): free user Paul asks how to change his avatar.",
        "BIL-2231, high priority. Pro customer Greta was charged twice this month.",
        "Ticket QRS-5120: the export button crashes the app for enterprise client Hiro Sato. Medium.",
        "ACC-3300, medium: pro user Ines wants to merge two accounts.",
        "Ticket BUG-0999, urgent, enterprise customer Omar Ali: data loss after sync.",
        "LOW-1111: free user Kai suggests a dark mode. Priority low.",
        "Ticket PAY-4500, high: pro customer Lena's invoice shows the wrong VAT.",
        "Ticket DOC-0042 medium, free user Ravi: broken link in the docs.",
        "Ticket SEC-7777, urgent: enterprise client Mona reports a leaked API key.",
    ],
}

INSTRUCTION = "Extract the information from the text as JSON matching the schema. Text: "


def structured_lines(max_tokens: int = 256, temperature: float = 0.0) -> list[dict[str, Any]]:
    """50 batch lines, 10 per schema, each with ``response_format`` ``json_schema`` (strict)."""
    lines = []
    for name, schema in SCHEMAS.items():
        for i, text in enumerate(TEXTS[name]):
            lines.append(
                {
                    "custom_id": f"{name}-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "gpt-4o-mini",
                        "messages": [
                            {"role": "system", "content": f"You extract {name} records as JSON."},
                            {"role": "user", "content": INSTRUCTION + text},
                        ],
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": name, "schema": schema, "strict": True},
                        },
                        "max_tokens": max_tokens,
                        "temperature": temperature,
                    },
                }
            )
    return lines


def write_jsonl(path: str, lines: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
