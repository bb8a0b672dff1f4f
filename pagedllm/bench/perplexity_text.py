"""The text `pagedllm bench accuracy` measures perplexity on: the opening of the United States Declaration
of Independence (1776, public domain), shipped in the package so every run reads the same tokens."""

TEXT = """\
When in the Course of human events, it becomes necessary for one people to dissolve the political bands which \
have connected them with another, and to assume among the powers of the earth, the separate and equal station to \
which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind requires \
that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator \
with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure \
these rights, Governments are instituted among Men, deriving their just powers from the consent of the governed, \
That whenever any Form of Government becomes destructive of these ends, it is the Right of the People to alter or \
to abolish it, and to institute new Government, laying its foundation on such principles and organizing its \
powers in such form, as to them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, \
will dictate that Governments long established should not be changed for light and transient causes; and \
accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are sufferable, than \
to right themselves by abolishing the forms to which they are accustomed. But when a long train of abuses and \
usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute Despotism, it is \
their right, it is their duty, to throw off such Government, and to provide new Guards for their future \
security. Such has been the patient sufferance of these Colonies; and such is now the necessity which constrains \
them to alter their former Systems of Government. The history of the present King of Great Britain is a history \
of repeated injuries and usurpations, all having in direct object the establishment of an absolute Tyranny over \
these States. To prove this, let Facts be submitted to a candid world.

He has refused his Assent to Laws, the most wholesome and necessary for the public good.

He has forbidden his Governors to pass Laws of immediate and pressing importance, unless suspended in their \
operation till his Assent should be obtained; and when so suspended, he has utterly neglected to attend to them.

He has refused to pass other Laws for the accommodation of large districts of people, unless those people would \
relinquish the right of Representation in the Legislature, a right inestimable to them and formidable to tyrants \
only.

He has called together legislative bodies at places unusual, uncomfortable, and distant from the depository of \
their public Records, for the sole purpose of fatiguing them into compliance with his measures.

He has dissolved Representative Houses repeatedly, for opposing with manly firmness his invasions on the rights \
of the people.

He has refused for a long time, after such dissolutions, to cause others to be elected; whereby the Legislative \
powers, incapable of Annihilation, have returned to the People at large for their exercise; the State remaining \
in the mean time exposed to all the dangers of invasion from without, and convulsions within.

He has endeavoured to prevent the population of these States; for that purpose obstructing the Laws for \
Naturalization of Foreigners; refusing to pass others to encourage their migrations hither, and raising the \
conditions of new Appropriations of Lands.

He has obstructed the Administration of Justice, by refusing his Assent to Laws for establishing Judiciary powers.

He has made Judges dependent on his Will alone, for the tenure of their offices, and the amount and payment of \
their salaries.

He has erected a multitude of New Offices, and sent hither swarms of Officers to harrass our people, and eat out \
their substance.

He has kept among us, in times of peace, Standing Armies without the Consent of our legislatures.

He has affected to render the Military independent of and superior to the Civil power.
"""
