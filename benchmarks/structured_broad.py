# ruff: noqa: E501  (the texts are one line each, as a user writes them)
"""A broad structured-output benchmark set: 12 JSON schemas of the kinds people send, 10 lines each
(120 in all), as an OpenAI batch file. Written before the JSON layout was tuned (issue 39), and not
around any one model: the schemas are what extraction and classification jobs ask for, the texts are
plain, and the prompt does not show the schema (as with OpenAI's ``response_format`` in vLLM).

What the schemas cover, between them: arrays with ``maxItems`` and without (``pros``, ``line_items``,
``entities``, ``steps`` have none), arrays of objects, nested objects, optional properties (not in
``required``), ``["string", "null"]`` unions, bounded integers and numbers, enums, ``anyOf``, strings
with ``pattern`` and with ``format`` (``date``, ``date-time``, ``email``), ``maxLength``, booleans;
some schemas are OpenAI-strict (every property required, ``additionalProperties: false``), some are
plain JSON Schema.

    python benchmarks/structured_broad.py            # rewrites benchmarks/data/structured_broad.jsonl

Every line: ``temperature: 0``, ``max_completion_tokens: 256``. The file is deterministic (a test
checks that the committed one is what this script writes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "structured_broad.jsonl"
MAX_COMPLETION_TOKENS = 256

_STR = {"type": "string"}


def _obj(props: dict[str, Any], required: list[str] | None = None, strict: bool = True) -> dict[str, Any]:
    """An object schema; ``required=None``: every property (OpenAI strict)."""
    req = list(props) if required is None else required
    out: dict[str, Any] = {"type": "object", "properties": props, "required": req}
    if strict:
        out["additionalProperties"] = False
    return out


SCHEMAS: dict[str, dict[str, Any]] = {
    "invoice": _obj(
        {
            "vendor": _STR,
            "invoice_number": {"type": "string", "pattern": "^[A-Z0-9-]{3,20}$"},
            "date": {"type": "string", "format": "date"},
            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
            "line_items": {
                "type": "array",
                "items": _obj(
                    {
                        "description": _STR,
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number", "minimum": 0},
                    }
                ),
            },
            "total": {"type": "number", "minimum": 0},
        }
    ),
    "contact": _obj(
        {
            "name": _STR,
            "email": {"type": "string", "format": "email"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{7,20}$"},
            "company": _STR,
            "tags": {"type": "array", "items": _STR},
        },
        required=["name", "email"],
        strict=False,
    ),
    "review": _obj(
        {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
            "pros": {"type": "array", "items": _STR},
            "cons": {"type": "array", "items": _STR},
            "would_recommend": {"type": "boolean"},
        }
    ),
    "meeting": _obj(
        {
            "title": _STR,
            "start": {"type": "string", "format": "date-time"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
            "attendees": {"type": "array", "items": _STR, "maxItems": 10},
            "location": {"type": ["string", "null"]},
        }
    ),
    "classify": _obj(
        {
            "label": {
                "type": "string",
                "enum": ["billing", "technical", "sales", "shipping", "returns", "account", "feedback", "other"],
            },
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "keywords": {"type": "array", "items": _STR, "maxItems": 5},
        }
    ),
    "job": _obj(
        {
            "title": _STR,
            "company": _STR,
            "location": _obj({"city": _STR, "country": _STR, "remote": {"type": "boolean"}}),
            "salary": {
                "anyOf": [
                    _obj(
                        {
                            "min": {"type": "integer", "minimum": 0},
                            "max": {"type": "integer", "minimum": 0},
                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                        }
                    ),
                    {"type": "null"},
                ]
            },
            "seniority": {"type": "string", "enum": ["intern", "junior", "mid", "senior", "lead"]},
            "requirements": {"type": "array", "items": _STR},
        }
    ),
    "paper": _obj(
        {
            "title": _STR,
            "authors": {"type": "array", "minItems": 1, "items": _obj({"first": _STR, "last": _STR})},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "venue": _STR,
            "doi": {"type": "string", "pattern": "^10\\.[0-9]{4,9}/[^ ]+$"},
        },
        required=["title", "authors", "year"],
    ),
    "order": _obj(
        {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4,8}$"},
            "customer": _obj({"name": _STR, "email": {"type": "string", "format": "email"}}),
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": _obj({"sku": _STR, "quantity": {"type": "integer", "minimum": 1, "maximum": 100}}),
            },
            "shipping": {"type": "string", "enum": ["standard", "express", "overnight", "pickup"]},
            "gift": {"type": "boolean"},
        },
        required=["order_id", "customer", "items", "shipping"],
    ),
    "entities": _obj(
        {
            "entities": {
                "type": "array",
                "items": _obj(
                    {"text": _STR, "type": {"type": "string", "enum": ["PERSON", "ORG", "LOCATION", "DATE", "MONEY"]}}
                ),
            }
        }
    ),
    "bug": _obj(
        {
            "component": {"type": "string", "enum": ["ui", "api", "database", "auth", "billing", "other"]},
            "severity": {"type": "integer", "minimum": 1, "maximum": 4},
            "summary": {"type": "string", "maxLength": 120},
            "steps": {"type": "array", "items": _STR},
            "version": {"anyOf": [{"type": "string", "pattern": "^[0-9]+\\.[0-9]+(\\.[0-9]+)?$"}, {"type": "null"}]},
        }
    ),
    "recipe": _obj(
        {
            "name": _STR,
            "servings": {"type": "integer", "minimum": 1, "maximum": 20},
            "ingredients": {
                "type": "array",
                "items": _obj(
                    {
                        "name": _STR,
                        "amount": {"type": "number", "exclusiveMinimum": 0},
                        "unit": {"type": "string", "enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece"]},
                    }
                ),
            },
            "vegetarian": {"type": "boolean"},
        }
    ),
    "answer": _obj(
        {
            "answer": {"anyOf": [{"type": "number"}, {"type": "string", "maxLength": 80}]},
            "unit": {"type": ["string", "null"]},
            "confidence": {"type": "string", "enum": ["low", "medium", "high"]},
        }
    ),
}

ASK: dict[str, str] = {
    "invoice": "Extract the invoice as JSON.",
    "contact": "Extract the contact details as JSON.",
    "review": "Analyse this product review and return JSON.",
    "meeting": "Extract the meeting as JSON.",
    "classify": "Classify this customer message and return JSON.",
    "job": "Extract the job posting as JSON.",
    "paper": "Extract the citation as JSON.",
    "order": "Extract the order as JSON.",
    "entities": "List the named entities in this text as JSON.",
    "bug": "Turn this bug report into JSON.",
    "recipe": "Extract the recipe as JSON.",
    "answer": "Answer the question and return JSON.",
}

TEXTS: dict[str, list[str]] = {
    "invoice": [
        "Invoice INV-2041 from Acme Supplies, dated 2025-03-02: 3 boxes of paper at $12.50 each, 1 stapler at $8.99. Total $46.49.",
        "Northwind Traders bill no. NW-77812, 14 May 2025. 10 x USB cables @ 4.20 EUR, 2 x chargers @ 19.90 EUR. Amount due: 81.80 EUR.",
        "Receipt 2025-0091 - Blue Bottle Cafe - 2025-01-17 - 2 lattes 4.50 GBP each, 1 croissant 3.20 GBP, total 12.20 GBP.",
        "Consulting invoice C-115 from Lee & Partners, issued 2024-11-30, 12 hours of advisory at 150 USD per hour, total 1800 USD.",
        "Tokyo Print Co. invoice TP-3009 (2025-06-01): 500 flyers at 20 JPY, 100 posters at 300 JPY. Total 40000 JPY.",
        "Bill from Swiss Alpine Gear, number SAG-42, date 2025-02-10: one tent CHF 320, two sleeping bags CHF 95 each. Total CHF 510.",
        "Invoice 88-ALPHA, Greenfield Farms, 2025-08-19. Items: 40 kg apples at 2.10 USD, 25 kg pears at 2.60 USD. Total due 149.00 USD.",
        "DataHost Ltd invoice DH-2025-031 dated 2025-03-31 for 1 month of server hosting at 89.00 GBP and 3 extra IPs at 2.00 GBP. Total 95.00 GBP.",
        "From: Studio Nine. Invoice SN-0007. Date: 2025-04-22. Logo design 1 x 600 EUR; business cards 200 x 0.25 EUR. Total 650 EUR.",
        "Invoice PX-99120 by Pixel Repair, 2025-07-07: screen replacement 1 at 129.99 USD, battery 1 at 49.99 USD, labour 1 at 40 USD, total 219.98 USD.",
    ],
    "contact": [
        "Hi, I'm Sarah Connor from Cyberdyne Systems. Reach me at sarah.connor@cyberdyne.com or +1 (555) 010-2233.",
        "Best regards, Miguel Alvarez, Head of Sales, Solaris Energy - miguel@solaris-energy.es",
        "You can email Priya at priya.k@gmail.com; she is a freelance photographer and also does video.",
        "Contact: Dr. Hans Mueller, hans.mueller@charite.de, phone +49 30 4505 0, cardiology department.",
        "Jamal Wright (jamal.wright@outlook.com) is a volunteer and donor; call him on 020 7946 0958.",
        "New lead from the conference: Emily Chen, CTO at Quantum Leap AI, emily@qleap.ai. Interested in the enterprise plan.",
        "Please add Olga Petrova to the newsletter list: olga.petrova@yandex.ru",
        "Signed, Tom Baker - tom@bakersbakery.co.uk - Baker's Bakery, supplier, wholesale, gluten-free.",
        "Our new landlord is Mr. Kenji Sato. His email is k.sato@satoestates.jp and his mobile is +81 90 1234 5678.",
        "Reach out to Fatima Al-Sayed, partner at Al-Sayed Law, fatima@alsayedlaw.com, for the contract review.",
    ],
    "review": [
        "Battery lasts two full days and the screen is gorgeous. The camera struggles in low light though. Would buy again.",
        "Stopped working after a week. Customer support never replied. Do not buy.",
        "It's fine. Does what it says, nothing special. The box was damaged on arrival.",
        "Comfortable, warm and the stitching is excellent. A bit pricey, and the sizing runs small.",
        "The blender is loud, leaks from the lid and the blades dulled in a month. Two stars for the nice color.",
        "Best headphones I have owned: noise cancelling is superb, pairing is instant, and they fold flat.",
        "Assembly took three hours, instructions were unclear and two screws were missing. Sturdy once built.",
        "Great value for money. Fast shipping. The app is clunky but the scale itself is accurate.",
        "The coffee tastes burnt and bitter. Packaging is nice. I will not order again.",
        "Lightweight, bright and the battery charges quickly. The clip broke off on day one, though.",
    ],
    "meeting": [
        "Let's do the quarterly planning on March 14, 2025 at 10:00 UTC for 90 minutes in Room 4B with Ana, Ben and Chloe.",
        "Reminder: 1:1 between Dave and Priya tomorrow, 2025-06-03T15:30:00Z, 30 min, on Zoom.",
        "Board meeting 2025-09-01 09:00 CET, two hours, at headquarters. Attendees: the CEO, the CFO, and all board members.",
        "Design review with the mobile team (Luis, Mei, Omar, Sven) on 2025-02-20 at 14:00 UTC, one hour, no room booked yet.",
        "Lunch and learn: 'Intro to Rust' on 2025-05-09T12:00:00+02:00, 45 minutes, cafeteria, open to everyone.",
        "Standup moved to 9:15 UTC on 2025-07-21 for 15 minutes, same Teams link. Team: Ada, Grace, Linus.",
        "Client kickoff with Globex on 2025-10-06 at 16:00 UTC. Plan for 3 hours. Location: Globex offices, Springfield.",
        "Interview for the senior engineer role with candidate Rosa Diaz, panel: Jake and Amy, 2025-04-11 11:00 UTC, 60 minutes.",
        "Team offsite brainstorm, 2025-08-28 from 10:00 to 16:00 UTC at the Lakeview Hotel.",
        "Quick sync about the outage at 2025-01-05T08:00:00Z, 20 minutes, phone bridge, with on-call engineers Kim and Raj.",
    ],
    "classify": [
        "I was charged twice for my subscription this month, please refund the duplicate payment.",
        "The app crashes every time I open the settings page on Android 14.",
        "Do you offer volume discounts for 500 seats? We'd like a quote.",
        "My package has been stuck in transit for ten days. Tracking number 1Z999AA10123456784.",
        "I want to return the shoes, they are too small. How do I get a label?",
        "I can't log in, the password reset email never arrives.",
        "Just wanted to say your support team was amazing yesterday. Thank you!",
        "Is there a way to export my data to CSV?",
        "The invoice shows the wrong VAT number for our company.",
        "What are your opening hours on public holidays?",
    ],
    "job": [
        "Senior Backend Engineer at Stripe, Dublin, Ireland (hybrid). EUR 90,000-120,000. Requirements: 5+ years Go or Java, distributed systems, on-call experience.",
        "We're hiring a Junior Data Analyst in Austin, TX! Fully remote OK. Salary: $55k-$70k. Must know SQL and Excel; Python a plus.",
        "Lead Designer - Figma Inc. - San Francisco, USA. On-site. Compensation not disclosed. 8 years product design, leading teams, design systems.",
        "Summer internship, machine learning research, DeepMind London UK, GBP 3000 per month. Requirements: PhD student, PyTorch, publications.",
        "Mid-level DevOps engineer wanted at Shopify, remote from Canada. 110000-140000 USD. Kubernetes, Terraform, CI/CD pipelines.",
        "Acme Corp seeks a senior accountant for its Berlin office, Germany. Salary 65,000 to 80,000 EUR. CPA, German fluency, SAP.",
        "Frontend developer (React, TypeScript), junior level, at a startup in Lisbon, Portugal, remote-friendly, salary negotiable.",
        "Staff Site Reliability Engineer at Netflix, Los Gatos, USA, USD 300000-450000, 10 years experience, Linux internals, incident command.",
        "Part-time barista at Bean There, Melbourne, Australia. On-site. No experience required; weekend availability.",
        "Mid-level mobile engineer at Revolut, London, United Kingdom, GBP 70k-90k, Kotlin or Swift, fintech experience preferred.",
    ],
    "paper": [
        "Vaswani, A., Shazeer, N., Parmar, N. et al. (2017). Attention Is All You Need. NeurIPS. doi:10.48550/arXiv.1706.03762",
        "Kwon W, Li Z, Zhuang S, et al. Efficient Memory Management for Large Language Model Serving with PagedAttention. SOSP 2023.",
        "He, Kaiming; Zhang, Xiangyu; Ren, Shaoqing; Sun, Jian. Deep Residual Learning for Image Recognition. CVPR, 2016.",
        "Dean, J. and Ghemawat, S. MapReduce: Simplified Data Processing on Large Clusters. OSDI 2004.",
        "Watson JD, Crick FH. Molecular structure of nucleic acids. Nature. 1953. https://doi.org/10.1038/171737a0",
        "Lamport, Leslie. 'Time, Clocks, and the Ordering of Events in a Distributed System.' Communications of the ACM (1978).",
        "Devlin J, Chang MW, Lee K, Toutanova K (2019) BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding. NAACL.",
        "Shannon, C. E. (1948). A Mathematical Theory of Communication. Bell System Technical Journal, 10.1002/j.1538-7305.1948.tb01338.x",
        "Yu, G.-I., Jeong, J. S., Kim, G.-W., Kim, S., Chun, B.-G. Orca: A Distributed Serving System for Transformer-Based Generative Models. OSDI 22.",
        "Ongaro and Ousterhout, In Search of an Understandable Consensus Algorithm, USENIX ATC 2014.",
    ],
    "order": [
        "Order AB12345 for Jane Doe (jane@example.com): 2 x SKU-RED-M, 1 x SKU-CAP-01. Ship express. It's a gift.",
        "New order CD998877 - customer Mark Lee, mark.lee@mail.com - 5 units of WIDGET-9 - standard shipping.",
        "Please process order XY0042: Anna Berg <anna.berg@web.de> wants 1 LAPTOP-15 and 2 MOUSE-WL, overnight delivery.",
        "Order ZZ777000 placed by Li Wei (liwei@qq.com). Items: TEA-GREEN x 10, TEA-BLACK x 10, KETTLE-1 x 1. Store pickup.",
        "Customer Paulo Santos, paulo@santos.br, order BR55501: 3 x COFFEE-1KG, standard shipping, not a gift.",
        "Order QA1001 - Grace Hopper - grace@navy.mil - items: KEYBOARD-MECH (1), MONITOR-27 (2). Express.",
        "Order MN20250 for Sam Green, sam.green@gmail.com: 4 x BOOK-PY, 1 x BOOK-SQL. Overnight, gift wrapped.",
        "Ref. TT9090: customer Rita Ora (rita@music.com) ordered 12 x CANDLE-VAN. Standard post.",
        "Order number GH31337 from Neo Anderson, neo@matrix.io - SUNGLASSES-BLK x 1, COAT-LONG x 1 - pickup in store.",
        "Order KL600100: Amelie Poulain, amelie@cafe.fr, 2 x GNOME-GARDEN, 6 x PHOTO-BOOTH, express.",
    ],
    "entities": [
        "Tim Cook announced on Monday that Apple will open a new campus in Austin.",
        "The European Central Bank raised rates by 0.25% on 14 September 2023, said Christine Lagarde in Frankfurt.",
        "Elon Musk's SpaceX launched 22 Starlink satellites from Cape Canaveral on Friday.",
        "Microsoft agreed to buy Activision Blizzard for $68.7 billion in January 2022.",
        "Marie Curie won the Nobel Prize in Chemistry in 1911 while working in Paris.",
        "On 20 July 1969, Neil Armstrong and Buzz Aldrin landed on the Moon for NASA.",
        "Angela Merkel met Emmanuel Macron in Berlin to discuss the EU budget of 1.8 trillion euros.",
        "Toyota recalled 50,000 cars in Japan and the United States last week.",
        "Satya Nadella spoke at the Davos forum in Switzerland on 17 January 2024.",
        "The World Health Organization, based in Geneva, declared the end of the emergency in May 2023.",
    ],
    "bug": [
        "Clicking 'Save' on the profile page does nothing in v2.3.1. Steps: log in, open profile, change name, click Save. Nothing is saved.",
        "API returns 500 when the 'limit' query param is 0. Reproduce: GET /v1/items?limit=0. Version 1.8.",
        "Users get logged out every 5 minutes since the last deploy. Critical! Happens on all browsers.",
        "Invoice totals are off by one cent for amounts with three decimals. Version 4.0.2. Create an item priced 1.005, add to invoice, check total.",
        "Dark mode: text in the settings dialog is black on dark grey and unreadable. Cosmetic.",
        "Database migration 0042 fails on PostgreSQL 16 with 'column already exists'. Run migrate on a fresh DB, then run it again.",
        "Password reset links expire immediately. Steps: request reset, open email, click link. Shows 'expired'. Seen in 3.2.",
        "The export to CSV drops rows with unicode names. Export the customers table and compare counts.",
        "Typo on the pricing page: 'anual' should be 'annual'.",
        "Payments page hangs forever when the card is declined (version 5.1.0). Steps: add declined test card, pay, wait.",
    ],
    "recipe": [
        "Classic pancakes (serves 4): 200 g flour, 300 ml milk, 2 eggs, 1 tbsp sugar, 1 tsp baking powder, a pinch of salt.",
        "Guacamole for 2: 2 avocados, 1 lime, half an onion, 1 tsp salt, a handful of cilantro.",
        "Spaghetti carbonara, 4 servings: 400 g spaghetti, 150 g guanciale, 4 egg yolks, 50 g pecorino, black pepper.",
        "Overnight oats for one: 50 g oats, 150 ml milk, 1 tbsp chia seeds, 1 tsp honey, berries on top.",
        "Chicken curry for 6: 1 kg chicken thighs, 2 onions, 400 ml coconut milk, 3 tbsp curry paste, 1 cup rice.",
        "Tomato soup (serves 3): 1 kg tomatoes, 1 onion, 2 cloves garlic, 500 ml vegetable stock, 2 tbsp olive oil.",
        "Chocolate chip cookies, makes 24 (8 servings): 250 g butter, 200 g sugar, 2 eggs, 300 g flour, 200 g chocolate chips.",
        "Greek salad for 2: 2 tomatoes, 1 cucumber, 100 g feta, 10 olives, 2 tbsp olive oil, oregano.",
        "Beef chili (serves 8): 1 kg ground beef, 2 cans kidney beans, 1 l crushed tomatoes, 2 tbsp chili powder, 1 onion.",
        "Banana smoothie for 1: 1 banana, 200 ml milk, 1 tbsp peanut butter, 3 ice cubes.",
    ],
    "answer": [
        "What is the boiling point of water at sea level in Celsius?",
        "How many legs does a spider have?",
        "What is the capital of Australia?",
        "How far is the Moon from the Earth on average, in kilometres?",
        "Who wrote the novel Pride and Prejudice?",
        "What is 15% of 240?",
        "Which planet is known as the Red Planet?",
        "How many minutes are there in a day?",
        "What is the chemical symbol for gold?",
        "What is the speed of light in a vacuum in metres per second?",
    ],
}

SYSTEM = "You are a helpful assistant that returns structured data as JSON."


def broad_lines(max_tokens: int = MAX_COMPLETION_TOKENS) -> list[dict[str, Any]]:
    """The 120 lines, schema by schema; ``custom_id`` is ``<schema>-<i>``."""
    lines = []
    for name, schema in SCHEMAS.items():
        strict = schema.get("additionalProperties") is False and set(schema["required"]) == set(schema["properties"])
        for i, text in enumerate(TEXTS[name]):
            lines.append(
                {
                    "custom_id": f"{name}-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "gpt-4o-mini",
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"{ASK[name]}\n\n{text}"},
                        ],
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": name, "schema": schema, "strict": strict},
                        },
                        "max_completion_tokens": max_tokens,
                        "temperature": 0,
                    },
                }
            )
    return lines


def schema_of(custom_id: str) -> dict[str, Any]:
    return SCHEMAS[custom_id.rsplit("-", 1)[0]]


def file_text(lines: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def main() -> None:
    DATA.parent.mkdir(parents=True, exist_ok=True)
    lines = broad_lines()
    DATA.write_text(file_text(lines))
    print(f"wrote {len(lines)} lines over {len(SCHEMAS)} schemas to {DATA}")


if __name__ == "__main__":
    main()
