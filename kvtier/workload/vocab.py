"""Word lists for the synthetic workload text (slot fillers for ``text.py`` templates).

Large and varied on purpose: different conversations must draw different tokens, so the
prefix cache only hits where a real service would (shared persona prompts, a
conversation's own history), never on filler words repeated everywhere.
"""

from __future__ import annotations


def _words(block: str) -> tuple[str, ...]:
    items = [w.strip() for line in block.strip().splitlines() for w in line.split(",")]
    return tuple(dict.fromkeys(w for w in items if w))


FIRST_NAMES = _words("""
Aaliyah, Abel, Ada, Adrian, Aiko, Alba, Alejandro, Amara, Ambrose, Amelie, Anand, Anika, Anselm, Arjun, Astrid,
Aurelio, Avery, Basil, Beatriz, Benedikt, Bianca, Bodhi, Bram, Callum, Camille, Cassius, Celeste, Chidi, Cillian,
Clementine, Cosima, Dagny, Dalia, Dario, Deja, Desmond, Dimitri, Dolores, Eamon, Edith, Elio, Elodie, Emeka, Enzo,
Esme, Ezra, Fabian, Farah, Felix, Fenna, Fiona, Florian, Freya, Gabriel, Gemma, Gideon, Greta, Hana, Hamish,
Harriet, Hector, Helga, Hiro, Idris, Ilse, Imani, Inigo, Ingrid, Isadora, Ivo, Jasper, Jovana, Juno, Kaito,
Kamala, Karim, Katja, Keanu, Kiri, Lars, Leandro, Leila, Lennox, Liesel, Linnea, Lorenzo, Lucia, Lukas, Mabel,
Magnus, Maia, Malik, Marisol, Mateo, Matilda, Maxine, Mei, Milo, Mira, Nadia, Naveen, Nell, Niamh, Nikolai,
Noor, Octavia, Odette, Olek, Orla, Osei, Otto, Paloma, Pascal, Petra, Priya, Quentin, Quinn, Rafael, Rania,
Reza, Rhea, Ronan, Rosalind, Rune, Sabine, Samir, Saoirse, Sasha, Selma, Silas, Sofia, Soren, Suki, Tamsin,
Tariq, Thea, Tobias, Tove, Ulla, Umar, Valentina, Vesna, Viggo, Wanda, Wendell, Xiomara, Yara, Yusuf, Zadie,
Zaid, Zelda, Zora
""")

CHARACTER_NAMES = _words("""
Captain Marrow, Lady Vesper, Old Tobin, Professor Quill, Sister Anwen, Raven Hollis, Doctor Ysolde, Kestrel Vane,
Grandma Pips, Sir Bartholomew, Echo-7, Mistress Lune, Brother Caedmon, Navigator Jyn, Oracle Thessaly, Bramble,
Coach Delgado, Madame Sorrel, Wren Ashdown, Commander Halvard, Juniper Moss, Archivist Pell, Nova Sterling,
Uncle Fergus, Sable Nightingale, Tinker Obadiah, Aunt Marigold, Ranger Tamsin, Chef Anatole, Lyric
""")

ARCHETYPES = _words("""
a retired lighthouse keeper who collects shipwreck stories, a sarcastic space pirate with a soft heart,
a gentle counselor who runs a late-night tea shop, an eccentric botanist obsessed with carnivorous plants,
a chatty barista from a rainy harbor town, a stoic knight who is secretly afraid of geese,
a cheerful android learning what feelings are, a grumpy wizard who teaches at a village school,
a supportive fitness coach who loves terrible puns, a mysterious fortune teller at a travelling carnival,
a curious alien anthropologist studying human habits, a warm grandmother who bakes for the whole street,
a witty detective in a foggy port city, a shy librarian who guards a magical archive,
a dramatic opera singer between engagements, a laid-back surfer philosopher,
an anxious young dragon who hoards books instead of gold, a blunt army medic turned gardener,
a kind vampire who only drinks beetroot juice, a cosmic radio host broadcasting from a moon base,
a mischievous forest spirit who loves riddles, a patient chess grandmaster who runs a park club,
a time-travelling historian stuck in the present, a poetic ship's cat who can talk,
a street musician who knows every alley of the old city, a calm monk who keeps bees on a mountain
""")

TRAITS = _words("""
affectionate, bashful, blunt, bookish, brave, candid, cheeky, compassionate, contemplative, courteous, curious,
deadpan, dependable, diplomatic, dreamy, earnest, eloquent, energetic, excitable, flamboyant, forgiving, frank,
gallant, generous, gentle, goofy, gracious, gruff, hopeful, humble, idealistic, imaginative, impulsive, inquisitive,
irreverent, jovial, kind-hearted, loyal, meticulous, mischievous, modest, moody, nostalgic, nurturing, observant,
old-fashioned, optimistic, patient, perceptive, philosophical, playful, poetic, practical, protective, proud,
quirky, rebellious, reserved, resilient, romantic, sardonic, sentimental, serene, skeptical, sly, soft-spoken,
spirited, steadfast, stubborn, superstitious, tender, theatrical, thoughtful, tireless, unflappable, whimsical,
witty, wry, zealous
""")

PLACES = _words("""
Lisbon, Oslo, Nairobi, Kyoto, Valparaiso, Reykjavik, Tbilisi, Montreal, Hanoi, Marrakesh, Edinburgh, Cusco,
Ljubljana, Hobart, Porto, Bergen, Zanzibar, Tallinn, Quito, Galway, Salzburg, Busan, Cartagena, Bruges, Dubrovnik,
Antigua, Luang Prabang, Tromso, Asheville, Savannah, Sedona, Halifax, Whitby, Colmar, Bologna, Seville, Krakow,
Matera, Hallstatt, Chefchaouen, Oaxaca, Ushuaia, Lofoten, Kotor, Sintra, Nara, Hoi An, Jaipur, Pokhara, Queenstown,
Wellington, Fremantle, Victoria, Juneau, Santa Fe, Taos, Duluth, Portland, Burlington, Galveston, Key West, Tofino,
Yellowknife, Inverness, Cork, Aarhus, Lund, Turku, Tartu, Riga, Vilnius, Brno, Graz, Lucerne, Annecy, Nantes, Lille,
Ghent, Leiden, Utrecht, Bremen, Leipzig, Trieste, Lecce, Palermo, Valencia, Bilbao, Granada, Faro, Madeira, Azores
""")

SETTINGS = _words("""
the old harbor, a rooftop garden, the night market, a mountain cabin, the corner bakery, a quiet library,
the train station, a seaside campsite, the community pool, a crowded bus, the dentist's waiting room,
my grandmother's kitchen, the office break room, a bookshop cafe, the hospital cafeteria, the dog park,
a laundromat, the farmers market, a basement gym, an airport lounge, the ferry deck, a hiking trail,
the school parking lot, a karaoke bar, the public observatory, a thrift store, the beach boardwalk,
a noisy food court, the botanical garden, a tiny ramen shop, the roller rink, the river path
""")

HOBBIES = _words("""
pottery, birdwatching, rock climbing, sourdough baking, knitting, chess, skateboarding, calligraphy, origami,
gardening, salsa dancing, trail running, watercolor painting, woodworking, amateur astronomy, bouldering,
crossword puzzles, film photography, journaling, beekeeping, fencing, kayaking, tabletop roleplaying games,
embroidery, cello, ukulele, jazz piano, speedcubing, bonsai, geocaching, archery, sailing, cross-stitch,
candle making, fermenting kimchi, mushroom foraging, stand-up comedy, improv theater, bird photography,
metal detecting, model trains, rollerblading, pickleball, bullet journaling, leather crafting, glassblowing,
stargazing, ice skating, swing dancing, slam poetry, composting, aquascaping, fly fishing, book binding,
latte art, lock picking, cosplay, vinyl collecting, yoga, tai chi, parkour, surfing, snowboarding
""")

FOODS = _words("""
lemon tart, ramen, mango sticky rice, shakshuka, pierogi, miso soup, banana bread, pad see ew, pho, tamales,
paella, falafel, pumpkin soup, cinnamon rolls, dumplings, arepas, jollof rice, goulash, bibimbap, lasagna,
chili crisp noodles, croissants, churros, tiramisu, apple crumble, lentil curry, tacos al pastor, poutine,
baklava, katsu curry, fish and chips, empanadas, borscht, spanakopita, gyoza, clam chowder, okonomiyaki,
peach cobbler, matcha cheesecake, chocolate babka, rice pudding, cornbread, pesto pasta, onigiri, ceviche
""")

PETS = _words("""
one-eyed tabby cat, very dramatic beagle, two lazy goldfish, rescue greyhound, chatty parrot,
nervous hamster, grumpy old pug, hedgehog that hates mornings, black cat who steals socks,
corgi with too much energy, tortoise older than me, pair of guinea pigs, bearded dragon,
husky who howls at sirens, fluffy rabbit, three-legged terrier, Maine coon the size of a dog
""")

PET_NAMES = _words("""
Biscuit, Pickles, Noodle, Waffles, Mochi, Pepper, Turnip, Marble, Sprout, Crumpet, Nugget, Juniper, Pretzel,
Ziggy, Basil, Olive, Tofu, Cosmo, Fig, Pancake, Dumpling, Mango, Ravioli, Sushi, Clover, Bramble, Gizmo, Kiwi
""")

JOBS = _words("""
nurse, night-shift baker, software tester, high school chemistry teacher, bus driver, graphic designer,
veterinary assistant, paralegal, warehouse supervisor, barista, line cook, dental hygienist, electrician,
sound engineer, museum guide, data analyst, physiotherapist, carpenter, customer support agent, pharmacist,
librarian, park ranger, wedding photographer, delivery driver, call center trainer, radio producer,
architecture student, accountant, tattoo artist, flight attendant, social worker, lab technician, translator
""")

RELATIVES = _words("""
my older sister, my little brother, my mom, my dad, my grandma, my grandpa, my cousin, my aunt, my uncle,
my best friend, my roommate, my partner, my stepdad, my niece, my nephew, my neighbor, my coworker, my boss,
my ex, my lab partner, my landlord, my therapist, my coach, my childhood friend
""")

EVENTS = _words("""
a job interview, my cousin's wedding, a chemistry exam, a first date, a dentist appointment, a moving day,
a piano recital, a marathon, a family reunion, a performance review, a surprise party, a driving test,
a thesis defense, a camping trip, a concert, a court hearing, a garage sale, a hackathon, a funeral,
a baby shower, a book club meeting, a chess tournament, a bake sale, an art exhibition, a road trip,
a hospital checkup, a graduation ceremony, a salary negotiation, a karaoke night, a soccer final
""")

EMOTIONS = _words("""
anxious, thrilled, lonely, homesick, grateful, frustrated, nervous, proud, overwhelmed, restless, hopeful,
heartbroken, embarrassed, jealous, relieved, nostalgic, bored, inspired, exhausted, giddy, bitter, content,
confused, curious, melancholy, furious, tender, uneasy, elated, drained, guilty, optimistic, sentimental
""")

WEATHER = _words("""
pouring rain, thick fog, a heatwave, freezing drizzle, the first snow, a thunderstorm, gusty wind, hail,
a gorgeous sunset, endless grey clouds, a crisp autumn morning, a muggy evening, a double rainbow, sleet
""")

OBJECTS = _words("""
a chipped blue mug, a broken umbrella, a vintage typewriter, a cracked phone screen, a mystery key,
a stack of old letters, a secondhand bicycle, a squeaky door, a half-finished scarf, a jar of buttons,
a polaroid camera, a cassette tape, a lucky coin, a leaky kettle, a pocket watch, a hand-drawn map,
a dusty violin, a stubborn zipper, a pair of muddy boots, a lava lamp, a dried-out fountain pen
""")

MEDIA = _words("""
a mystery novel about a lighthouse, a documentary about octopuses, an old kung fu movie, a cozy farming game,
a podcast about unsolved heists, a fantasy series with dragons, a cooking show from Osaka, a space opera,
a graphic novel about time loops, an indie horror game, a sitcom from the nineties, a nature series about owls,
a true crime podcast, a romantic comedy set in Paris, a poetry collection, a strategy board game,
a biography of a jazz drummer, a sci-fi novel about a generation ship, an anime about volleyball
""")

TIMES = _words("""
this morning, last night, yesterday afternoon, on Sunday, at lunch, after work, around midnight, last weekend,
two days ago, before breakfast, during my commute, on my break, last month, earlier today, at dawn
""")

ACTIVITIES = _words("""
reorganizing my closet, cooking dinner for friends, walking along the river, painting my bedroom,
fixing a leaky faucet, studying for finals, cleaning out the garage, learning a new recipe,
writing a letter to an old friend, practicing scales, assembling furniture, planning a trip, repotting plants,
binge-watching a series, volunteering at the shelter, jogging in the park, sorting old photos, baking bread,
playing video games until late, helping my neighbor move, trying to meditate, making a playlist
""")

ADJECTIVES = _words("""
strange, wonderful, awkward, peaceful, chaotic, ridiculous, bittersweet, surreal, exhausting, delightful,
frustrating, unexpected, hilarious, quiet, intense, magical, clumsy, lovely, weird, tender, gloomy, bright,
messy, cozy, eerie, spectacular, ordinary, humbling, dizzying, fragile, sparkling, rusty, sleepy, stormy
""")

TOPICS = _words("""
whether people can really change, why we dream, how to make friends as an adult, the best way to learn a language,
what makes a place feel like home, how to forgive someone, whether luck is real, why music gives us chills,
how to stop procrastinating, what to do with a free Saturday, how to tell someone bad news,
whether it is okay to quit something, how to deal with a noisy neighbor, why some memories fade,
how to be brave, whether ghosts exist, how to save money for a trip, what makes a good apology
""")
